"""export_pretrained's LoRA options refused when they cannot apply, before any collective."""
import sys

import paddle
import pytest
from launcher import WORKERS

import paddle_cp as pcp

pytest.importorskip("paddleformers")
sys.path.insert(0, str(WORKERS))
from paddleformers_models import build  # noqa: E402


def test_merge_lora_needs_a_lora_model(tmp_path):
    paddle.seed(0)
    with pytest.raises(TypeError, match="merge_lora=True needs a PaddleFormers LoRAModel"):
        pcp.export_pretrained(build("llama"), str(tmp_path / "out"), merge_lora=True)
    with pytest.raises(TypeError, match="merge_lora must be True or False"):
        pcp.export_pretrained(build("llama"), str(tmp_path / "out"), merge_lora="yes")
    assert not (tmp_path / "out").exists()
