"""Published long-context training recipes, to say which one a planned layout resembles (pure data).

Each entry is what its source says, read with the team's search tool (the repository files named); `note`
says what could not be verified. GPU counts of the Megatron-Bridge recipes are their degrees' product at
data-parallel 1 (their docstrings give degrees, not cluster sizes), except where NeMo 2's recipe of the same
name sets the nodes. Megatron's distributed optimizer shards optimizer state over dp x cp; torchtitan's FSDP
shards parameters, gradients and optimizer state over dp_shard x cp; ALST runs ZeRO-3 over its Ulysses ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MEGATRON_BRIDGE = "NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/recipes/llama/llama3.py"


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    params: float  # model parameters
    seq: int
    devices: int
    tp: int
    pp: int
    cp: int
    dp: int
    sharding: str  # how the state is divided, in the source's words
    recompute: str
    note: str = ""

    @property
    def degrees(self):
        return f"TP{self.tp} PP{self.pp} CP{self.cp} DP{self.dp} on {self.devices} GPUs"


RECIPES = (
    Recipe("Megatron-Bridge llama3_8b_128k", MEGATRON_BRIDGE + "; NVIDIA/NeMo nemo/collections/llm/recipes/"
           "llama3_8b_128k.py (8 nodes x 8)", 8.0e9, 131072, 64, 4, 2, 8, 1,
           "distributed optimizer (dp x cp)", "none", "sequence parallel on; micro-batch 1, global batch 512"),
    Recipe("Megatron-Bridge llama3_8b_64k", MEGATRON_BRIDGE, 8.0e9, 65536, 32, 4, 2, 4, 1,
           "distributed optimizer (dp x cp)", "none", "GPU count not stated: the degrees' product"),
    Recipe("Megatron-Bridge llama3_70b_64k", MEGATRON_BRIDGE, 70.6e9, 65536, 256, 8, 4, 8, 1,
           "distributed optimizer (dp x cp)", "none",
           "GPU count not stated; NeMo 2's llama3_70b_64k sets CP4 on 16 nodes x 8 instead"),
    Recipe("Megatron-Bridge llama3_70b_16k", MEGATRON_BRIDGE, 70.6e9, 16384, 32, 8, 2, 2, 1,
           "distributed optimizer (dp x cp)", "none", "GPU count not stated: the degrees' product"),
    Recipe("torchtitan Llama 3.1 8B, FSDP 2 x CP 4", "pytorch/torchtitan docs/performance.md, Table 2", 8.0e9,
           131072, 8, 1, 1, 4, 2, "FSDP over dp_shard x cp", "full",
           "8 H100 (96 GB), 84.0 GiB; torch.compile + Float8; FSDP 1 x CP 8 reached 262144 tokens"),
    Recipe("DeepSpeed ALST, Llama-8B on one node", "arXiv 2506.13996 (Snowflake ArcticTraining / DeepSpeed)",
           8.0e9, 3_700_000, 8, 1, 1, 8, 1, "ZeRO-3 over the Ulysses ranks, optimizer states on the host",
           "full, offloaded to CPU",
           "also 500K on 1 H100 and 15M on 32 H100 (Ulysses over all); tiled loss and MLP; per-run flags "
           "beyond these figures not verified"),
)


def _distance(recipe, params, layout, seq):
    logs = [math.log2(a / b) for a, b in ((recipe.tp, layout.tp), (recipe.pp, layout.pp), (recipe.cp, layout.cp),
                                          (recipe.dp, layout.dp))]
    return 2 * abs(math.log2(recipe.params / params)) + sum(map(abs, logs)) + 0.5 * abs(math.log2(recipe.seq / seq))


def closest(params, layout, seq):
    """The published recipe nearest to `layout` (model size first, then degrees, then length) and how they
    differ: {"recipe", "source", "degrees", "differs", "note"}."""
    recipe = min(RECIPES, key=lambda r: _distance(r, params, layout, seq))
    ours = {"TP": layout.tp, "PP": layout.pp, "CP": layout.cp, "DP": layout.dp}
    theirs = {"TP": recipe.tp, "PP": recipe.pp, "CP": recipe.cp, "DP": recipe.dp}
    differs = [f"{k}{ours[k]} here vs {k}{theirs[k]}" for k in ours if ours[k] != theirs[k]]
    if seq != recipe.seq:
        differs.append(f"{seq} tokens here vs {recipe.seq}")
    return {"recipe": recipe.name, "source": recipe.source, "degrees": recipe.degrees,
            "sharding": recipe.sharding, "recompute": recipe.recompute, "differs": differs, "note": recipe.note}
