"""Batches the model workers train on: random ids, optionally packed documents."""
import numpy as np
import paddle


def make_batch(seq, packed):
    """ids, labels, position ids (restarting at each packed document), the single card's mask and
    the documents' end rows ([b, 1, s]: key j is seen by rows j..end-1)."""
    paddle.seed(99)
    ids = paddle.randint(0, 128, [2, seq + 1])
    positions = np.broadcast_to(np.arange(seq), (2, seq)).copy()
    mask = ends = None
    if packed:
        rng = np.random.RandomState(seq)
        doc = np.stack([np.searchsorted(np.sort(rng.choice(np.arange(2, seq - 1), 3, replace=False)),
                                        np.arange(seq), side="right") for _ in range(2)])
        starts = np.maximum.accumulate(np.where(np.diff(doc, prepend=-1, axis=1) != 0, np.arange(seq), 0), axis=1)
        positions = np.arange(seq) - starts
        same = doc[:, :, None] == doc[:, None, :]
        mask = paddle.to_tensor((same & np.tri(seq, dtype=bool))[:, None])
        ends = paddle.to_tensor(seq - same[:, ::-1, :].argmax(axis=1), dtype="int32").unsqueeze(1)
    return ids[:, :-1], ids[:, 1:], paddle.to_tensor(positions, dtype="int64"), mask, ends
