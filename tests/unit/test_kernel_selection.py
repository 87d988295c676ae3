"""select_kernel: the first kernel of the ordered registry (flash, flashmask, blockwise) whose supports() runs the
block, for every device, dtype, build, head dims and kind of mask. The device and the build's ops are substituted
(as tests/workers/emulated_flash.py does) so the GPU's choices are checked on CPU."""
import numpy as np
import paddle
import pytest

from paddle_cp.attention import kernels
from paddle_cp.attention.kernels import flash, flashmask
from paddle_cp.attention.masks.block_mask import BlockMask, Documents

SEQ = 16
POSITIONS = np.arange(SEQ)


def _mask(kind):
    padded = np.ones([1, SEQ], bool)
    padded[0, -3:] = False
    return {
        None: None,
        "causal": BlockMask(POSITIONS, POSITIONS, True),
        "all": BlockMask(POSITIONS, POSITIONS, False),
        "documents": BlockMask(POSITIONS, POSITIONS, True, Documents.from_ids(np.array([[0] * 5 + [1] * 11]))),
        "window": BlockMask(POSITIONS, POSITIONS, True, window=4),
        "padding": BlockMask(POSITIONS, POSITIONS, True, valid=padded),
        "dense": BlockMask(POSITIONS, POSITIONS, False,
                           dense=paddle.to_tensor(np.tri(SEQ, k=-3, dtype=bool)[None, None])),
    }[kind]


# (on a GPU, dtype, the build's flash op, its flashmask op, v's head dim (q/k's: 8), mask) -> the kernel chosen
TABLE = [
    (True, "bfloat16", True, True, 8, None, "flash"),
    (True, "float16", True, True, 8, None, "flash"),
    (True, "bfloat16", True, True, 8, "causal", "flash"),
    (True, "bfloat16", True, True, 8, "all", "flash"),
    (True, "bfloat16", True, True, 8, "documents", "flashmask"),
    (True, "bfloat16", True, True, 8, "window", "flashmask"),
    (True, "float16", True, True, 8, "padding", "flashmask"),
    (True, "bfloat16", True, False, 8, "documents", "blockwise"),  # no flashmask op in the build
    (True, "bfloat16", True, True, 8, "dense", "blockwise"),  # a dense mask: neither op expresses it
    (True, "bfloat16", True, True, 4, None, "blockwise"),  # MLA: v's head dim differs
    (True, "bfloat16", True, True, 4, "documents", "blockwise"),
    (True, "float32", True, True, 8, None, "blockwise"),  # fp32
    (True, "float32", True, True, 8, "documents", "blockwise"),
    (False, "bfloat16", True, True, 8, None, "blockwise"),  # CPU
    (False, "bfloat16", True, True, 8, "documents", "blockwise"),
    (True, "bfloat16", False, False, 8, None, "blockwise"),  # no flash op at all
]


@pytest.mark.parametrize("gpu, dtype, has_flash, has_flashmask, v_head_dim, mask, chosen", TABLE)
def test_the_first_kernel_that_supports_the_block_is_chosen(monkeypatch, gpu, dtype, has_flash, has_flashmask,
                                                             v_head_dim, mask, chosen):
    monkeypatch.setattr(flash, "on_gpu", lambda tensor: gpu)
    monkeypatch.setattr(flash, "flash_available", lambda: has_flash)
    monkeypatch.setattr(flashmask, "flashmask_available", lambda: has_flashmask)
    q = paddle.zeros([1, SEQ, 2, 8], dtype)
    v = paddle.zeros([1, SEQ, 2, v_head_dim], dtype)
    kernel = kernels.select_kernel(q, v, _mask(mask))
    assert type(kernel).name == chosen
    assert [k.name for k in kernels.KERNELS if k.supports(_mask(mask), q, v)][0] == chosen


def test_the_registry_is_ordered_flash_flashmask_blockwise_and_blockwise_runs_anything():
    assert [kernel.name for kernel in kernels.KERNELS] == ["flash", "flashmask", "blockwise"]
    q = paddle.zeros([1, SEQ, 2, 8], "float32")
    assert all(kernels.BlockwiseKernel.supports(_mask(kind), q, q)
               for kind in (None, "causal", "documents", "window", "padding", "dense"))
