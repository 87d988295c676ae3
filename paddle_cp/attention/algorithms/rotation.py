"""How ring attention gets the other members' k/v, and sends k/v gradients home.

`planned` (default; planned_exchange.py): only the k/v rows a member's tiles read, straight from their
owner (one shift a step, the next in flight while the current block is computed on), and only those rows'
gradients back. It is exact for every mask the ring takes (a row no query of a member sees weighs exactly
0 there, so leaving it out changes nothing), and never sends more than whole blocks: with nothing masked it
sends every block to every member, as `allgather` does.
`allgather` (PyTorch's set_rotate_method "allgather"): one all-gather of all whole blocks up front, one
reduce-scatter of the gradients at the end: two collective calls a direction instead of N-1 shifts, no
overlap with compute, N blocks held; for rings whose exchanges are too small for the shifts' per-call cost
to hide (short sequences on many ranks), chosen by the user.
A rotation hands out messages (`fetch`), makes a member's k and v blocks of one (`unpack`), takes each
block's (dk, dv) (`send_grads`) and returns this member's (`own_grads`). A block no query sees
(ring.sees_nothing) has no gradient: `send_grads(step, None)`. Made with `received` (the messages its
forward fetched, by step: ring.keeps_received), a backward's rotation hands those out and fetches nothing;
its gradients go as without.
"""
from __future__ import annotations

import numpy as np
import paddle

from ...comm import collectives, p2p

ROTATIONS = ("planned", "allgather")
GRAD_DTYPE = paddle.float32  # the kernels' k/v gradients (attention/kernels), packed


def check_rotation(rotate):
    if rotate not in ROTATIONS:
        raise ValueError(f"unknown k/v rotation {rotate!r}: use one of {list(ROTATIONS)}")
    return rotate


class BlockPacking:
    """Packing of a member's k and v into one flat message; their head dims may differ (MLA)."""

    def __init__(self, k, v, lengths):
        self.k_shape, self.v_shape, self.lengths = list(k.shape), list(v.shape), lengths

    def shapes(self, length):
        return [[self.k_shape[0], length, *self.k_shape[2:]], [self.v_shape[0], length, *self.v_shape[2:]]]

    def numel(self, length):
        """Elements of `length` rows of k and v, packed."""
        return sum(int(np.prod(shape)) for shape in self.shapes(length))

    def numels(self):
        return [self.numel(n) for n in self.lengths]

    def unpack(self, flat, src):
        """k and v of ring member `src`."""
        return p2p.unpack(flat, self.shapes(self.lengths[src]))


class AllGatherRotation:
    """Whole blocks, packed flat (k then v); `numels[i]`: member i's packed size (lengths may differ)."""

    def __init__(self, group, k, v, masks, received=None):
        self.group, self.packing = group, BlockPacking(k, v, masks.lengths())
        self.numels = self.packing.numels()
        self._width = max(self.numels)
        self._received = received
        if received is None:
            gathered = collectives.all_gather(group, self._padded(p2p.pack([k, v])), tag="ring")
            self._blocks = [block[:n] for block, n in zip(gathered, self.numels)]
        self._grads = [None] * group.size

    def _padded(self, flat):
        missing = self._width - flat.shape[0]
        return flat if not missing else paddle.concat([flat, paddle.zeros([missing], flat.dtype)])

    def fetch(self, step):
        if self._received is not None:
            return self._received[step]
        return self._blocks[(self.group.index - step) % self.group.size]

    def unpack(self, flat, src):
        return self.packing.unpack(flat, src)

    def send_grads(self, step, grads):
        """`grads`: (dk, dv) of the block fetched at `step`, or None (the block was skipped)."""
        self._grads[(self.group.index - step) % self.group.size] = (
            None if grads is None else self._padded(p2p.pack(list(grads))))

    def own_grads(self):
        """(dk, dv) of this member's block, every member's part summed."""
        if any(g is None for g in self._grads):  # blocks with no gradient: one zero buffer stands for all (only read)
            zeros = paddle.zeros([self._width], GRAD_DTYPE)
            self._grads = [zeros if g is None else g for g in self._grads]
        summed = collectives.reduce_scatter(self.group, self._grads, tag="ring")
        return self.packing.unpack(summed[: self.numels[self.group.index]], self.group.index)
