"""How ring attention gets every member's k/v block, and sends k/v gradients home.

`ring` (default): blocks travel one hop per step, the next one in flight while
the current is computed on. In backward each block's gradient sum starts at the
member after its owner and travels with the blocks: the owner keeps its own
contribution until the sum of the others' arrives, so dk/dv make N-1 hops, the
minimum (as k/v do). Memory: two blocks. `allgather` (PyTorch's set_rotate_method
"allgather"): one all-gather of all blocks up front, one reduce-scatter of the
gradients at the end; fewer, larger messages, N blocks held. Same bytes.
Blocks are packed flat; `numels[i]` is member i's packed size (lengths may differ).
A block no query sees (ring.sees_nothing) has no gradient: `send_grads(step, None)` adds nothing to the
sum passing through (zeros are made only where a message must still leave with no sum to carry).
"""
from __future__ import annotations

import paddle

from ..comm import collectives, p2p

ROTATIONS = ("ring", "allgather")
GRAD_DTYPE = paddle.float32  # the kernels' k/v gradients (attention/kernels), packed


def check_rotation(rotate):
    if rotate not in ROTATIONS:
        raise ValueError(f"unknown k/v rotation {rotate!r}: use one of {list(ROTATIONS)}")
    return rotate


class RingRotation:
    def __init__(self, group, kv, numels):
        self.group, self.numels = group, numels
        self._current, self._next, self._travelling, self._own = kv, None, None, None

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

    def send_grads(self, step, dkv):
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

    def own_grads(self):
        """This member's block's gradient: its own part plus the sum of every other member's."""
        others = None if self._travelling is None else self._travelling.wait()  # None: a ring of one
        if self._own is None:
            return others if others is not None else paddle.zeros([self.numels[self.group.index]], GRAD_DTYPE)
        return self._own if others is None else self._own + others


class AllGatherRotation:
    def __init__(self, group, kv, numels):
        self.group, self.numels = group, numels
        self._width = max(numels)
        gathered = collectives.all_gather(group, self._padded(kv), tag="ring")
        self._blocks = [block[:n] for block, n in zip(gathered, numels)]
        self._grads = [None] * group.size

    def _padded(self, flat):
        missing = self._width - flat.shape[0]
        return flat if not missing else paddle.concat([flat, paddle.zeros([missing], flat.dtype)])

    def fetch(self, step):
        return self._blocks[(self.group.index - step) % self.group.size]

    def send_grads(self, step, dkv):
        self._grads[(self.group.index - step) % self.group.size] = None if dkv is None else self._padded(dkv)

    def own_grads(self):
        if any(g is None for g in self._grads):  # blocks with no gradient: one zero buffer stands for all (only read)
            zeros = paddle.zeros([self._width], GRAD_DTYPE)
            self._grads = [zeros if g is None else g for g in self._grads]
        summed = collectives.reduce_scatter(self.group, self._grads, tag="ring")
        return summed[: self.numels[self.group.index]]


def make_rotation(rotate, group, kv, numels):
    return {"ring": RingRotation, "allgather": AllGatherRotation}[check_rotation(rotate)](group, kv, numels)
