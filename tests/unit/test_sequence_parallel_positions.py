"""Paddle's sequence-parallel plan on PaddleFormers' Llama called without position_ids, as on one card.

SequenceParallelBegin turns the embeddings into [s/mp, b, h] on any mp size, so one
process (mp=1) already shows whether the model derives positions from that shape."""
import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from llama_models import SIZES, build_llama

import paddle_cp as pcp


def sequence_parallel_plan():
    """Paddle's documented sequence-parallel layout for Llama."""
    return {
        "model.embed_tokens": [pcp.ColWiseParallel(), pcp.SequenceParallelBegin()],
        "model.layers.*.self_attn": pcp.SequenceParallelDisable(),
        "model.layers.*.mlp": pcp.SequenceParallelDisable(need_transpose=False),
        "lm_head.weight": pcp.ColWiseParallel(),
        "lm_head": pcp.SequenceParallelEnd(),
    }


def _eager_llama():
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SIZES, fuse_rms_norm=False))  # PaddleFormers' default: eager attention


def _parallelized(build=lambda: build_llama("paddleformers")):
    paddle.seed(5)
    model, reference = build(), build()
    reference.set_state_dict(model.state_dict())
    mesh = dist.ProcessMesh([0], dim_names=["mp"])
    pcp.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": sequence_parallel_plan()}})
    return model, reference


def test_positions_are_supplied_when_the_call_has_none():
    pytest.importorskip("paddleformers")
    model, reference = _parallelized()
    ids = paddle.randint(0, 128, [2, 12])
    labels = paddle.randint(0, 128, [2, 12])
    got, want = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), want[1].numpy(), atol=1e-5)


def test_eager_attention_is_refused_naming_the_fix():
    pytest.importorskip("paddleformers")
    model, _ = _parallelized(_eager_llama)
    with pytest.raises(ValueError, match="_attn_implementation='sdpa'"):
        model(input_ids=paddle.randint(0, 128, [2, 12]))
