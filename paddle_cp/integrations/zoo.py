"""The model library paddle_cp's tools and `pcp-train` build their models from (PaddleFormers), under neutral
names: the package outside integrations/ names no library."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

from .paddleformers import plans as decoder_plans  # noqa: F401 - the one writer of its decoder models' plans
from .paddleformers import recompute as decoder_recompute  # noqa: F401 - its recomputation config fields

LIBRARY = "paddleformers"
GATED_DELTA_MODULE = f"{LIBRARY}.transformers.qwen3_next.modeling"
GATED_DELTA_RULE = "paddle_chunk_gated_delta_rule"


def transformers():
    """The library's model and config classes (LlamaForCausalLM, LlamaConfig, GptOssForCausalLM, ...)."""
    return importlib.import_module(f"{LIBRARY}.transformers")


def gated_delta_rule():
    """PaddleFormers' gated delta rule, the one Qwen3-Next calls. Its module imports GPU-fleet packages
    (paddlefleet_ops) that CPU installs lack; then its two functions are read from that file, unchanged."""
    try:
        return getattr(importlib.import_module(GATED_DELTA_MODULE), GATED_DELTA_RULE)
    except ImportError:
        pass
    import paddle

    package = importlib.util.find_spec(LIBRARY)
    if package is None:
        raise SystemExit(f"pcp-bench --mixer gated_deltanet needs PaddleFormers (pip install {LIBRARY})")
    path = Path(package.submodule_search_locations[0]) / "transformers" / "qwen3_next" / "modeling.py"
    tree = ast.parse(path.read_text())
    functions = [node for node in tree.body
                 if isinstance(node, ast.FunctionDef) and node.name in ("l2norm", GATED_DELTA_RULE)]
    namespace = {"paddle": paddle, "F": paddle.nn.functional, "Tensor": paddle.Tensor}
    exec(compile(ast.Module(functions, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace[GATED_DELTA_RULE]


def training_cli(argv=None):
    """`pcp-train`: PaddleFormers' CLI workflow with paddle_cp underneath."""
    from .paddleformers.cli import main

    return main(argv)
