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
