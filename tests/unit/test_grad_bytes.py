"""paddle_cp/tools/memory/grad_bytes.py: gradient-reduction bytes per step from paddle_cp's bucket plan, fp32 master
gradients against bf16 ones, on a tiny PaddleFormers Llama built lazily from its config.json."""
import json
import math

import pytest

pytest.importorskip("paddleformers")

from paddle_cp.data_parallel.buckets import MB  # noqa: E402
from paddle_cp.tools.memory import grad_bytes  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


@pytest.fixture(scope="module")
def params(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return grad_bytes.lazy_parameters(str(path))


def test_master_gradients_send_twice_the_bytes_at_every_level(params):
    elements = sum(math.prod(p.shape) for p in params)
    bucket_mb = 8 * 64 * 128 / MB  # two MLP weights' worth of fp32 gradient
    result = grad_bytes.report(params, 4, bucket_mb)
    for level, by in result.items():
        master, low = by["master_grad"], by["bf16"]
        assert master["buckets"] > low["buckets"] > 1  # fp32 buckets hold half the parameters each
        assert master["max"] == pytest.approx(2 * low["max"], rel=1e-6), level
    # all-reduce: 2 (n-1)/n of every byte; reduce-scatter: the chunks a rank does not own (or the padded largest)
    assert result[0]["master_grad"]["max"] == pytest.approx(elements * 4 * 2 * 3 / 4, rel=1e-6)
    assert result[1]["master_grad"] == result[0]["master_grad"]
    scattered = result[2]["master_grad"]
    assert elements * 4 * 3 / 4 <= scattered["mean"] <= scattered["max"] <= elements * 4 * 2 * 3 / 4


def test_a_config_without_a_paddleformers_class_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError, match="architectures"):
        grad_bytes.lazy_parameters(str(path))
