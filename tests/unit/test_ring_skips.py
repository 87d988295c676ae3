"""Ring attention's kernel calls per ring step, forward and backward (attention/algorithms/ring.py), in one process: each
ring member's steps are run against a stand-in rotation that serves every member's k/v block and records the
k/v gradients each step sends home. A block no query sees runs no kernel in either direction; every other
block runs one each way; results are bit-for-bit those of running the kernel on every block, whether the
backward fetches the blocks again or reads the messages its forward kept (a replay's, ring.keeps_received).
The exchanges themselves are tested for real in tests/multiproc (test_context_parallel.py, test_gpu_path.py)."""
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from workers import emulated_flash

from paddle_cp.attention import kernels
from paddle_cp.attention.algorithms import ring, rotation
from paddle_cp.attention.dispatch.api import ring_masks
from paddle_cp.attention.masks.mask import Mask
from paddle_cp.attention.layout.sequence_layout import SequenceLayout
from paddle_cp.attention.masks.block_mask import Documents
from paddle_cp.attention.algorithms.merge import merge
from paddle_cp.comm import p2p
from paddle_cp.tools import packing

RING, SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM = 4, 1024, 1, 4, 2, 16
SCALE = HEAD_DIM ** -0.5


class StandInRotation:
    """Every member's packed k/v block at hand (or the messages a forward kept: `received`); the gradient each step
    sends (packed), kept by the block it is for."""

    def __init__(self, packed, index, packing, received=None):
        self.packed, self.index, self.packing, self.step, self.sent = packed, index, packing, None, {}
        self.received = received

    def fetch(self, step):
        self.step = step
        return self.packed[(self.index - step) % RING] if self.received is None else self.received[step]

    def unpack(self, flat, src):
        return self.packing.unpack(flat, src)

    def send_grads(self, step, grads):
        self.sent[(self.index - step) % RING] = None if grads is None else p2p.pack(list(grads))

    def own_grads(self):
        own = self.sent[self.index]
        return self.unpack(paddle.zeros(self.packed[self.index].shape, "float32") if own is None else own, self.index)


def _cases():
    """(name, layout, documents, window): short packed documents kept whole on a rank by the documents layout
    (most blocks seen by no query), and a sliding window over 2N chunks (the far blocks)."""
    positions = packing.packed_position_ids(np.array([100, 300, 50, 200, 90, 150, 134]), SEQ, 1)
    documents = Documents.from_position_ids(positions)
    yield "documents", SequenceLayout("p2p", RING).for_batch(documents), documents, None
    yield "window", SequenceLayout("p2p", RING), None, 96


def _inputs(layout, dtype):
    paddle.seed(5)
    q, k, v, dout = (paddle.randn([BATCH, SEQ, h, HEAD_DIM]) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    positions = layout.ring_positions(SEQ)
    shard = lambda x, i: paddle.gather(x, paddle.to_tensor(positions[i]), axis=1).astype(dtype)
    return [[shard(x, i) for i in range(RING)] for x in (q, k, v, dout)]


def _kernel_steps(monkeypatch, rotation_of):
    """{("forward" | "backward", member, step): kernel calls}, counted at every kernel class."""
    calls = {}
    for cls in (kernels.BlockwiseKernel, kernels.FlashKernel, kernels.FlashMaskKernel):
        for direction in ("forward", "backward"):
            original = cls.__dict__.get(direction)
            if original is None:
                continue

            def counted(self, *args, original=original, direction=direction):
                rotation = rotation_of["current"]
                key = (direction, rotation.index, rotation.step)
                calls[key] = calls.get(key, 0) + 1
                return original(self, *args)
            monkeypatch.setattr(cls, direction, counted)
    return calls


def _every_block(q, k_blocks, v_blocks, dout, masks, index):
    """The ring as it was: every block's kernel run in both directions (forward: all but the skipped blocks after
    the first, whose partial results merge from step 0), gradients summed over all blocks."""
    out = lse = None
    for step in range(RING):
        src = (index - step) % RING
        mask = masks.block(src)
        if out is not None and mask.extent().kind == "none":
            continue
        out, lse = merge(out, lse, *kernels.select_kernel(q, v_blocks[src], mask).forward(
            q, k_blocks[src], v_blocks[src], mask, SCALE))
    out_saved = out.astype(q.dtype)
    dq, dkv = None, {}
    for step in range(RING):
        src = (index - step) % RING
        mask = masks.block(src)
        dq_b, dk_b, dv_b = kernels.select_kernel(q, v_blocks[src], mask).backward(
            dout, q, k_blocks[src], v_blocks[src], out_saved, lse, mask, SCALE)
        dq = dq_b if dq is None else dq + dq_b
        dkv[src] = p2p.pack([dk_b, dv_b])
    return out, lse, dq, dkv


@pytest.mark.parametrize("path", ["blockwise", "flash"])
def test_backward_skips_the_blocks_forward_skips(monkeypatch, path):
    dtype = "float32"
    if path == "flash":
        emulated_flash.install(monkeypatch.setattr)
        dtype = "bfloat16"
    rotation_of = {}

    def stand_in(rotate, group, k, v, masks, received=None):
        packing = rotation.BlockPacking(k, v, masks.lengths())
        rotation_of["current"] = StandInRotation(rotation_of["packed"], group.index, packing, received)
        return rotation_of["current"]
    monkeypatch.setattr(ring, "make_rotation", stand_in)
    calls = _kernel_steps(monkeypatch, rotation_of)

    for name, layout, documents, window in _cases():
        qs, ks, vs, douts = _inputs(layout, dtype)
        rotation_of["packed"] = [p2p.pack([k, v]) for k, v in zip(ks, vs)]
        empty_blocks = 0
        for index in range(RING):
            calls.clear()
            masks = ring_masks(layout, SEQ, index, Mask(True, window, documents))
            group = SimpleNamespace(size=RING, index=index)
            keep = index % 2 == 1  # half the members' backwards read the messages their forwards kept
            out, lse, kept = ring.ring_forward(qs[index], ks[index], vs[index], group, masks, SCALE, "planned", keep)
            dq, dk, dv = ring.ring_backward(douts[index], qs[index], ks[index], vs[index], out.astype(dtype), lse,
                                            group, masks, SCALE, "planned", received=kept)
            sent = rotation_of["current"].sent
            for step in range(RING):
                seen = masks.block((index - step) % RING).extent().kind != "none"
                if keep:  # a message kept exactly where the step ran a kernel
                    assert (kept[step] is not None) == seen, (name, index, step)
                empty_blocks += not seen
                forward, backward = (calls.get((d, index, step), 0) for d in ("forward", "backward"))
                assert forward == backward == int(seen), (name, path, index, step, forward, backward)

            # bit-for-bit what running every block gave (a skipped block's gradient was exactly zero)
            ref_out, ref_lse, ref_dq, ref_dkv = _every_block(qs[index], ks, vs, douts[index], masks, index)
            assert np.array_equal(out.numpy(), ref_out.numpy()) and np.array_equal(lse.numpy(), ref_lse.numpy())
            assert np.array_equal(dq.numpy(), ref_dq.numpy()), (name, path, index)
            for src in range(RING):
                if sent[src] is None:
                    assert not ref_dkv[src].numpy().any(), (name, path, index, src)
                else:
                    assert np.array_equal(sent[src].numpy(), ref_dkv[src].numpy()), (name, path, index, src)
        assert empty_blocks >= RING, (name, empty_blocks)  # the case has blocks to skip
