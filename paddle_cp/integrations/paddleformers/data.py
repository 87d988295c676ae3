"""Each data-parallel rank's part of the batch one card would draw.

PaddleFormers' own distributed sampler shuffles a truncated index range and
deals samples round-robin, so its global batch is one card's only when the
dataset divides. Here every rank draws one card's batch of
`per_device_train_batch_size x dp` samples (same seed, same shuffle, same skip on
resume: `consumed_samples` counts global samples, as the Trainer passes it) and
keeps its contiguous slice; context- and tensor-parallel ranks of one replica
keep the same slice.
"""
from __future__ import annotations

from paddleformers.utils.batch_sampler import MappingBatchSampler


class DataParallelBatchSampler(MappingBatchSampler):
    def __init__(self, dataset, per_rank_batch_size, dp_size, dp_rank, shuffle, drop_last, data_seed):
        super().__init__(dataset, batch_size=per_rank_batch_size * dp_size, shuffle=shuffle, drop_last=drop_last,
                         data_seed=data_seed)
        self.per_rank, self.dp_size, self.dp_rank = per_rank_batch_size, dp_size, dp_rank
        last = len(dataset) % self.batch_size
        if not drop_last and last % dp_size:
            raise ValueError(
                f"the last batch of {last} samples ({len(dataset)} samples, global batch {self.batch_size}) does not "
                f"split over {dp_size} data-parallel ranks: set dataloader_drop_last=True or use a dataset size "
                "whose remainder divides")

    def __iter__(self):
        for batch in super().__iter__():
            share = len(batch) // self.dp_size  # the full per-rank batch, or an equal part of the last one
            yield batch[self.dp_rank * share:(self.dp_rank + 1) * share]
