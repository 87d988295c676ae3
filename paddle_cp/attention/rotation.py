"""How ring attention gets every member's k/v block, and sends k/v gradients home.

`ring` (default): blocks travel one hop per step, the next one in flight while
the current is computed on. In backward each block's gradient sum starts at the
member after its owner and travels with the blocks: the owner keeps its own
contribution until the sum of the others' arrives, so dk/dv make N-1 hops, the
minimum (as k/v do). Memory: two blocks. `allgather` (PyTorch's set_rotate_method
"allgather"): one all-gather of all blocks up front, one reduce-scatter of the
gradients at the end; fewer, larger messages, N blocks held. Same bytes.
`planned` (planned_exchange.py): only the k/v rows a member's tiles read, straight from their owner, and
only those rows' gradients back. A rotation hands out messages (`fetch`), makes a member's k and v blocks
of one (`unpack`), takes each block's (dk, dv) (`send_grads`) and returns this member's (`own_grads`).
Ring and allgather pack a member's k and v flat into one message; `numels[i]` is member i's packed size
(lengths may differ).
A block no query sees (ring.sees_nothing) has no gradient: `send_grads(step, None)` adds nothing to the
sum passing through (zeros are made only where a message must still leave with no sum to carry).
"""
from __future__ import annotations

import numpy as np
import paddle

from ..comm import collectives, p2p

ROTATIONS = ("ring", "allgather", "planned")
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

    def numels(self):
        per_token = sum(int(np.prod(shape)) for shape in self.shapes(1))
        return [per_token * n for n in self.lengths]

    def unpack(self, flat, src):
        """k and v of ring member `src`."""
        return p2p.unpack(flat, self.shapes(self.lengths[src]))


class _PackedRotation:
    """What ring and allgather share: whole blocks packed flat, gradients packed alike."""

    def __init__(self, group, k, v, masks):
        self.group, self.packing = group, BlockPacking(k, v, masks.lengths())
        self.numels = self.packing.numels()

    def unpack(self, flat, src):
        return self.packing.unpack(flat, src)

    def send_grads(self, step, grads):
        """`grads`: (dk, dv) of the block fetched at `step`, or None (the block was skipped)."""
        self._send_flat(step, None if grads is None else p2p.pack(list(grads)))

    def own_grads(self):
        """(dk, dv) of this member's block, every member's part summed."""
        return self.packing.unpack(self._own_flat(), self.group.index)


class RingRotation(_PackedRotation):
    def __init__(self, group, k, v, masks):
        super().__init__(group, k, v, masks)
        self._current, self._next, self._travelling, self._own = p2p.pack([k, v]), None, None, None

    def _source(self, step):
        return (self.group.index - step) % self.group.size

    def fetch(self, step):
        """The block of member index-step; the next one is put in flight first."""
        if step > 0:
            self._current = self._next.wait()
        if step < self.group.size - 1:
            shape = [self.numels[self._source(step + 1)]]
            self._next = p2p.shift(self.group, self._current, 1, tag="ring", recv_shape=shape)
        return self._current

    def _send_flat(self, step, dkv):
        """Gradient for the block fetched at `step`: this member's own block's stays here; any other
        joins the sum arriving from the previous member and goes on towards the block's owner."""
        if step == 0:
            self._own = dkv
            return
        if self._travelling is not None:
            arrived = self._travelling.wait()
            dkv = arrived if dkv is None else dkv + arrived
        if dkv is None:  # nothing computed for this block yet, and the next member waits for its sum
            dkv = paddle.zeros([self.numels[self._source(step)]], GRAD_DTYPE)
        shape = [self.numels[self._source(step + 1)]]
        self._travelling = p2p.shift(self.group, dkv, 1, tag="ring", recv_shape=shape)

    def _own_flat(self):
        """This member's block's gradient: its own part plus the sum of every other member's."""
        others = None if self._travelling is None else self._travelling.wait()  # None: a ring of one
        if self._own is None:
            return others if others is not None else paddle.zeros([self.numels[self.group.index]], GRAD_DTYPE)
        return self._own if others is None else self._own + others


class AllGatherRotation(_PackedRotation):
    def __init__(self, group, k, v, masks):
        super().__init__(group, k, v, masks)
        self._width = max(self.numels)
        gathered = collectives.all_gather(group, self._padded(p2p.pack([k, v])), tag="ring")
        self._blocks = [block[:n] for block, n in zip(gathered, self.numels)]
        self._grads = [None] * group.size

    def _padded(self, flat):
        missing = self._width - flat.shape[0]
        return flat if not missing else paddle.concat([flat, paddle.zeros([missing], flat.dtype)])

    def fetch(self, step):
        return self._blocks[(self.group.index - step) % self.group.size]

    def _send_flat(self, step, dkv):
        self._grads[(self.group.index - step) % self.group.size] = None if dkv is None else self._padded(dkv)

    def _own_flat(self):
        if any(g is None for g in self._grads):  # blocks with no gradient: one zero buffer stands for all (only read)
            zeros = paddle.zeros([self._width], GRAD_DTYPE)
            self._grads = [zeros if g is None else g for g in self._grads]
        summed = collectives.reduce_scatter(self.group, self._grads, tag="ring")
        return summed[: self.numels[self.group.index]]
