"""What `pcp-plan --config` reads: a config.json, a model folder holding one, or the name of a model whose
published config.json fields are kept here, so the docs' commands run without downloading one."""
from __future__ import annotations

import json
from pathlib import Path

# the fields pcp-plan reads, as the models' own config.json files give them (Meta's, Qwen's)
LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "tie_word_embeddings": False}
NAMED = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": {**LLAMA3_8B, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                   "intermediate_size": 28672},
    "qwen2.5-7b": {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    # Qwen2.5-VL-7B-Instruct's config.json: its text fields at the top, its tower's under vision_config
    # (PaddleFormers 1.2.0's Qwen2_5_VLConfig() defaults differ: docs/vision_language.md)
    "qwen2.5-vl-7b": {"model_type": "qwen2_5_vl", "num_hidden_layers": 28, "hidden_size": 3584,
                      "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                      "vocab_size": 152064, "tie_word_embeddings": False,
                      "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                        "in_chans": 3, "patch_size": 14, "temporal_patch_size": 2,
                                        "spatial_merge_size": 2, "window_size": 112,
                                        "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 3584,
                                        "tokens_per_second": 2, "hidden_act": "silu"}},
}


def read_model_config(source):
    """The config dict `source` names: a known model name, a config.json file, or a folder holding config.json."""
    if source.lower() in NAMED:
        return dict(NAMED[source.lower()])
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--config {source}: no such file; give a config.json (PaddleFormers / Hugging Face), a model "
                         f"folder holding one, one of the names {sorted(NAMED)}, or the shape flags --layers "
                         "--hidden --heads --kv-heads --vocab --intermediate")
    return json.loads(path.read_text())
