"""What PaddleFormers' families register with the core (paddle_cp/integrations/paddleformers/models.py):
their MoE blocks by class, their attention modules as softmax attention, and their fused-weight rules;
a block or attention class of another library is the core's only through its own registration."""
import pytest

pytest.importorskip("paddleformers")

import paddle_cp as pcp  # noqa: E402
from paddle_cp.attention.mixers import SoftmaxAttention, mixer_of  # noqa: E402
from paddle_cp.experts.blocks import find_moe_block  # noqa: E402
from paddle_cp.integrations.paddleformers.models import fused_weights  # noqa: E402

MOE = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE", "glm4_moe": "Glm4MoeMoE",
       "gpt_oss": "GptOssMLP"}


def _model(family):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
    from paddleformers_models import build

    return build(family)


@pytest.mark.parametrize("family", list(MOE))
def test_moe_blocks_and_attention_are_recognized(family):
    model = _model(family)
    layers = dict(model.named_sublayers())
    blocks = {name: find_moe_block(layer) for name, layer in layers.items() if find_moe_block(layer)}
    assert blocks and all(MOE[family] in block.kind.classes for block in blocks.values())
    assert isinstance(mixer_of(layers["model.layers.0.self_attn"]), SoftmaxAttention)


def test_fused_qkv_rule_follows_the_class_aoa_config():
    phi3, qwen3 = _model("phi3"), _model("qwen3")
    q_k_v = fused_weights(phi3)  # fused_qkv_old: q | k | v, each part split on its own
    attention = phi3.model.layers[0].self_attn
    assert q_k_v("model.layers.0.self_attn.qkv_proj", attention.qkv_proj, attention) == (64, 32, 32)
    gate_up = phi3.model.layers[0].mlp.gate_up_proj
    assert q_k_v("model.layers.0.mlp.gate_up_proj", gate_up, phi3.model.layers[0].mlp) == (128, 128)
    assert q_k_v("model.layers.0.self_attn.o_proj", attention.o_proj, attention) is None
    # Qwen3's _gen_aoa_config says fused_qkv: columns grouped by k/v head, split plainly (whole groups per rank)
    attention = qwen3.model.layers[0].self_attn
    assert fused_weights(qwen3)("model.layers.0.self_attn.qkv_proj", attention.qkv_proj, attention) is None


def test_another_librarys_classes_are_the_cores_only_once_registered():
    import paddle

    class MyAttention(paddle.nn.Layer):
        pass

    assert mixer_of(MyAttention()) is None
    pcp.register_attention_class(lambda cls: cls is MyAttention)
    assert isinstance(mixer_of(MyAttention()), SoftmaxAttention)
    with pytest.raises(TypeError, match="BlockKind"):
        pcp.register_block_kind(("MyMoE",))
