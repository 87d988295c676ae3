"""Model libraries reach the core only through their integration (paddle_cp/integrations/): the core names no
library except in libraries.py's table, imports no integration, and registers a library's facts when it meets
one of its models."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "paddle_cp"
INTEGRATIONS = PACKAGE / "integrations"
# the rooms below integrations/ and tools/: none may import an integration
CORE = ["paddle_cp", "paddle_cp.runtime", "paddle_cp.mesh", "paddle_cp.params", "paddle_cp.dtypes",
        "paddle_cp.libraries", *(f"paddle_cp.{p.name}" for p in sorted(PACKAGE.iterdir())
                                 if (p / "__init__.py").is_file() and p.name not in ("integrations", "tools"))]


def _run(code):
    env = {**os.environ, "PYTHONPATH": f"{PACKAGE.parent}{os.pathsep}{PACKAGE.parent / 'tests'}"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_no_library_named_outside_integrations_but_the_table():
    hits = [(str(path.relative_to(PACKAGE.parent)), line) for path in sorted(PACKAGE.rglob("*.py"))
            if INTEGRATIONS not in path.parents
            for line in path.read_text().splitlines() if "paddleformers" in line]
    assert [path for path, _ in hits] == ["paddle_cp/libraries.py"], hits
    assert re.fullmatch(r'INTEGRATIONS = \{"paddleformers": "paddle_cp\.integrations\.paddleformers"\}', hits[0][1])


def test_the_core_imports_no_integration():
    imports = "; ".join(f"import {module}" for module in CORE)
    loaded = "sorted(m for m in sys.modules if m.startswith('paddle_cp.integrations'))"
    out = _run(f"import sys; {imports}; print({loaded})")
    assert out == "[]" and len(CORE) > 10


def test_parallelize_registers_the_library_of_the_model_it_meets():
    """No import of the integration: parallelize (and load_pretrained, export_pretrained) meet a PaddleFormers
    model and import it, which registers its attention adapter, weight format, recompute rule, fused weights and
    one MoE block kind or vision-language rules per file in families/."""
    pytest.importorskip("paddleformers")
    out = _run("""
import sys
import paddle_cp as pcp
from paddle_cp.experts.blocks import find_moe_block
from paddle_cp.runtime import installed
from workers.paddleformers_models import build
model = build("deepseek_v3")
blocks = [layer for layer in model.sublayers() if type(layer).__name__ == "DeepseekV3MoE"]
before = (find_moe_block(blocks[0]), len(installed.block_kinds), "paddle_cp.integrations" in sys.modules)
assert pcp.parallelize_model(model) is model
from paddle_cp.integrations.paddleformers import families
block = find_moe_block(blocks[0])
modules = [sys.modules[name] for name in sorted(sys.modules) if name.startswith(families.__name__ + ".")]
family_blocks = [module.BLOCK for module in modules if hasattr(module, "BLOCK")]
rules = [rule for module in modules for rule in getattr(module, "RULES", ()) + ((module.RULE,) if hasattr(module, "RULE") else ())]
print(before, len(family_blocks), family_blocks == installed.block_kinds, block.kind.fallback_flag,
      block.shared_experts()[0], sorted(installed.attention_adapters), len(installed.weight_formats),
      len(installed.recompute_settings), len(installed.fused_weight_rules), len(rules), rules == installed.vision_language)
""")
    assert out == ("(None, 0, False) 4 True fd_fallback shared_experts ['paddleformers_attention'] 1 1 1 7 True"), out


def test_a_model_of_no_library_splits_its_fused_projections_by_name():
    """No integration imported: a fused qkv_proj is q | k | v and a gate_up_proj gate | up halves, each split on
    its own (the core's rule for any model no library's rule takes)."""
    out = _run("""
import sys
import paddle.distributed as dist
import paddle_cp as pcp
from paddle_cp.plans.column_info import column_info
from workers.doc_llama import LlamaForCausalLM
model = LlamaForCausalLM(num_layers=1)
pcp.parallelize(model, None, dist.ProcessMesh([0], dim_names=["mp"]), {"mp_config": {"parallelize_plan": {
    "llama.layers.*.self_attn.qkv_proj": pcp.ColWiseParallel(), "llama.layers.*.mlp.gate_up_proj": pcp.ColWiseParallel()}}})
layer = model.llama.layers[0]
print(column_info(layer.self_attn.qkv_proj).parts, column_info(layer.mlp.gate_up_proj).parts,
      "paddle_cp.integrations" in sys.modules)
""")
    assert out == "(16, 16, 16) (24, 24) False", out


def test_architecture_shows_a_family_file_as_it_is():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    path = "paddle_cp/integrations/paddleformers/families/glm4_moe.py"
    shown = text[text.index(f"# {path}\n") + len(path) + 3:]
    assert shown[:shown.index("```")] == (PACKAGE.parent / path).read_text()
