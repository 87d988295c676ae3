"""One candidate layout of a training run, and the cluster it runs on (pure, no Paddle).

A layout's name lists its degrees and options as tokens, e.g. `dp2 ring4 uly1 tp8 pp2 m8 l3 full chunk4096
tile4096 offload host-optimizer`;
`Layout.parse` reads such a name back (spaces or commas between tokens; omitted tokens take the defaults).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

RECOMPUTE_FULL = "full"
NO_RECOMPUTE = "none"
SHARD_DIMS = ("dp", "sep")  # sharding's default: every rank holding a replica
# Bytes per device no fit may use: the CUDA context and libraries' workspaces (~1 GB), NCCL's buffers (~1 GB) and
# the caching allocator's fragmentation (~3 GB of 80), none of which the memory model counts.
DEFAULT_RESERVE = 5e9


@dataclass(frozen=True)
class Cluster:
    devices: int
    memory: float  # bytes per device
    flops: float  # achievable FLOP/s per device for this model's matmuls (GEMMs)
    intra_bandwidth: float  # bytes/s per device within a node
    inter_bandwidth: float  # bytes/s per device across nodes
    devices_per_node: int
    attention_flops: float = 0.0  # achievable FLOP/s of causal attention forward + backward (0: `flops`)
    pcie_bandwidth: float = 25e9  # bytes/s per device and direction between device and host memory
    host_memory: float = 2e12  # bytes of host memory per node for offloaded activations (DGX H100: 2 TB)
    # parameters/s one device's share of its host steps (dp_config offload_optimizer): Paddle's CPU AdamW kernel on
    # one thread, its default (5.6e8/s measured; the casts run on the device); 8 ranks at once on one host lose
    # 0-11% (docs/long_sequences.md)
    host_adamw_rate: float = 5.6e8
    reserve: float = DEFAULT_RESERVE  # bytes per device left free (DEFAULT_RESERVE says what for)

    @property
    def usable_memory(self):
        """Bytes per device a layout may plan for: the memory less the reserve."""
        return self.memory - self.reserve

    @property
    def attention_rate(self):
        return self.attention_flops or self.flops


@dataclass(frozen=True)
class Layout:
    """Degrees, outermost first: pipeline, data, ring, Ulysses, tensor (tensor innermost: fastest links).

    micro: micro-batches per step (the pipeline's accumulate_steps); vpp: model chunks per pipeline rank
    (interleaved 1F1B); ep: expert-parallel degree, folded onto the dp x sep ranks (ep_config);
    sharding: dp_config's level, over `shard_dims`; recompute: "none", "full" (whole layers) or selective
    modules joined by "+" ("core_attn+mlp"); loss_chunk: tokens per chunk of a chunked lm_head + loss
    (0: the whole sequence at once); mlp_tile: tokens per tile of SequenceTiled MLPs (0: untiled); offload:
    full recomputation's saved layer inputs kept in host memory (OffloadRecomputeInputs); offload_optimizer:
    the optimizer state (and fp32 master weights) in host memory, stepped there (dp_config
    `offload_optimizer`). Tensor parallelism always runs with sequence parallelism.
    """

    dp: int = 1
    ring: int = 1
    ulysses: int = 1
    tp: int = 1
    pp: int = 1
    micro: int = 1
    vpp: int = 1
    ep: int = 1
    sharding: int = 0
    shard_dims: tuple = SHARD_DIMS
    recompute: str = NO_RECOMPUTE
    loss_chunk: int = 0
    mlp_tile: int = 0
    offload: bool = False
    offload_optimizer: bool = False

    def __post_init__(self):
        object.__setattr__(self, "shard_dims", tuple(self.shard_dims))  # a list when read back from JSON

    @property
    def cp(self):
        return self.ring * self.ulysses

    @property
    def devices(self):
        return self.pp * self.dp * self.cp * self.tp

    @property
    def backend(self):
        if self.cp == 1:
            return "none"
        if self.ring > 1 and self.ulysses > 1:
            return "hybrid"
        return "all2all" if self.ulysses > 1 else "p2p"

    @property
    def shard_ranks(self):
        """Ranks a dense parameter's sharded state is divided over."""
        return self.dp * (self.cp if "sep" in self.shard_dims else 1)

    @property
    def selective(self):
        """The selectively recomputed modules (empty for none or full)."""
        return () if self.recompute in (NO_RECOMPUTE, RECOMPUTE_FULL) else tuple(self.recompute.split("+"))

    @property
    def bubble(self):
        """Interleaved 1F1B's idle share of a step: (p-1)/(v*m + p-1) (v = 1: plain 1F1B)."""
        return (self.pp - 1) / (self.vpp * self.micro + self.pp - 1)

    @property
    def name(self):
        tokens = [f"dp{self.dp} ring{self.ring} uly{self.ulysses} tp{self.tp}"]
        if self.pp > 1:
            tokens.append(f"pp{self.pp} m{self.micro}" + (f" vpp{self.vpp}" if self.vpp > 1 else ""))
        if self.ep > 1:
            tokens.append(f"ep{self.ep}")
        if self.sharding:
            tokens.append(f"l{self.sharding}" + ("" if self.shard_dims == SHARD_DIMS else "@" + "+".join(self.shard_dims)))
        if self.recompute != NO_RECOMPUTE:
            tokens.append(self.recompute if self.recompute == RECOMPUTE_FULL else "sel:" + self.recompute)
        if self.loss_chunk:
            tokens.append(f"chunk{self.loss_chunk}")
        if self.mlp_tile:
            tokens.append(f"tile{self.mlp_tile}")
        if self.offload:
            tokens.append("offload")
        if self.offload_optimizer:
            tokens.append("host-optimizer")
        return " ".join(tokens)

    @classmethod
    def parse(cls, name):
        """The layout a name describes: `dp2 ring2 l3@dp`, `ring4,full,chunk256`, `tp2 uly2 sel:core_attn+mlp`."""
        values = {}
        numbers = {"dp": "dp", "ring": "ring", "uly": "ulysses", "tp": "tp", "pp": "pp", "m": "micro", "vpp": "vpp",
                   "ep": "ep", "chunk": "loss_chunk", "tile": "mlp_tile"}
        for token in re.split(r"[\s,]+", name.strip()):
            number = re.fullmatch(r"([a-z]+)(\d+)", token)
            level = re.fullmatch(r"l([0-3])(?:@([a-z+]+))?", token)
            if level:
                values["sharding"] = int(level.group(1))
                if level.group(2):
                    values["shard_dims"] = tuple(level.group(2).split("+"))
            elif number and number.group(1) in numbers:
                values[numbers[number.group(1)]] = int(number.group(2))
            elif token == RECOMPUTE_FULL or token.startswith("sel:"):
                values["recompute"] = token.removeprefix("sel:")
            elif token == "offload":
                values["offload"] = True
            elif token == "host-optimizer":
                values["offload_optimizer"] = True
            else:
                raise ValueError(f"layout {name!r}: cannot read {token!r}; tokens are dp<N> ring<N> uly<N> tp<N> pp<N> "
                                 "m<N> vpp<N> ep<N> l<0-3>[@dp|@sep|@dp+sep] full sel:<modules> chunk<N> tile<N> offload "
                                 "host-optimizer")
        layout = cls(**values)
        if not set(layout.shard_dims) <= set(SHARD_DIMS):
            raise ValueError(f"layout {name!r}: sharding runs over 'dp', 'sep' or both, not {layout.shard_dims}")
        if layout.offload and layout.recompute != RECOMPUTE_FULL:
            raise ValueError(f"layout {name!r}: offload keeps full recomputation's layer inputs on the host; add 'full'")
        return layout
