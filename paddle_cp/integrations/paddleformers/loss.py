"""Token counts for the loss rule, and the loss of each pipeline micro-batch.

Each rank's mean loss is weighted by `paddle_cp.loss_weight(local tokens)` so the
averaged gradients and the logged world mean are one card's token mean (README's
loss rule). Under pipeline parallel the schedule runs forward and backward itself and returns
the mean of its micro-batch losses, so a loss can only be weighted inside
pp_config's `loss_fn`. This one applies the model's own criterion to the logits
and this rank's labels (its context-parallel part, as the schedule hands them over), scaled by the micro-batch
count and by `per_token`: replicas / tokens of the whole step over all dp x sep
ranks (set by the Trainer before each forward). Mean over micro-batches, then
over replicas, is then the token mean of the global batch, as on one card.
"""
from __future__ import annotations

import paddle_cp as pcp


_DOCUMENT_INPUTS = ("position_ids", "attn_mask_startend_row_indices")  # what a packed batch's layout follows


def local_labels(labels, prepare_plan, inputs):
    """This rank's labels: its context-parallel part of its samples' labels, split as the model's
    inputs are (a batch of packed documents is split by its documents)."""
    if prepare_plan is None:
        return labels
    return pcp.shard_sequence(labels, backend=prepare_plan, **{key: inputs.get(key) for key in _DOCUMENT_INPUTS})


def local_tokens(labels, prepare_plan, ignored_label, inputs=None, mask=None):
    """Tokens whose loss this rank computes (one host read): its labelled ones, or where the criterion counts by a
    `mask` (a loss_mask), that mask's; `inputs`: the batch the model gets."""
    counted = labels != ignored_label if mask is None else mask.astype("bool")
    return int(local_labels(counted.astype("int64"), prepare_plan, inputs or {}).sum())


class PipelineLoss:
    def __init__(self, model, prepare_plan, micro_batches, ignored_label):
        criterion = getattr(model, "criterion", None)
        if criterion is None:
            raise ValueError(f"{type(model).__name__} has no `criterion` layer: pipeline_model_parallel_size > 1 "
                             "needs PaddleFormers' loss (model.criterion) or your own pp_config loss_fn")
        self.criterion, self.prepare_plan = criterion, prepare_plan
        self.micro_batches, self.ignored_label = micro_batches, ignored_label
        self.per_token = None

    def start_step(self, inputs):
        """Before a forward over `inputs` (this rank's whole batch): one all-reduce of the token count."""
        local = local_tokens(inputs["labels"], self.prepare_plan, self.ignored_label, inputs)
        self.per_token = pcp.loss_weight(local) / local if local else 0.0

    def __call__(self, output, labels):
        if self.per_token is None:
            raise RuntimeError("PipelineLoss.start_step(inputs) must run before the pipelined forward")
        # the schedule hands over labels already split like the inputs (PrepareContextParallel on the model)
        tokens = local_tokens(labels, None, self.ignored_label)
        if not tokens:  # the criterion's token mean would be 0/0: a zero from the logits
            return output[0].sum() * 0.0
        loss = self.criterion(output[0], labels)[0]
        return loss * (self.micro_batches * tokens * self.per_token)
