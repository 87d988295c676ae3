"""Cost model for choosing a parallel layout: pure functions, no Paddle, no devices.

Units: bytes, seconds, FLOPs. Every traffic figure is bytes *sent per rank* for
one forward+backward, the quantity paddle_cp.bytes_sent() counts.

Attention traffic (one attention call; local q [b, s/N, hq, d], k/v [b, s/N, hk, d],
`e` bytes per element, KV = bytes of the local k and v together):
- ring (backend p2p): forward passes k/v N-1 hops; backward passes k/v N-1
  hops again (recomputation instead of holding every block) and dk/dv N-1 hops
  (the owner keeps its own block's gradient until the sum of the others'
  arrives): 3(N-1) KV, the algorithm's minimum.
- Ulysses (backend all2all): all-to-all of q, k, v before and of out after
  attention sends (N-1)/N of each; the backward mirrors it. k/v heads fewer
  than N are repeated before the exchange (that is what travels). This is also
  the minimum for a head split: ratio 1.
- hybrid (USP): Ulysses over U ranks on s/R tokens, then the ring over R = N/U
  groups on the head-split k/v (h_k/U heads, repeated first when h_k < U).
Every figure is the minimum of its algorithm, and what paddle_cp sends.

Attention memory: activation bytes a rank holds between forward and backward
(inputs included), the thing context parallelism divides by N:
- single process / ring: q, k, v, out and the fp32 log-sum-exp [b, hq, s].
- Ulysses and hybrid: the same plus the head-split copies of q, k, v, out that
  the local attention saves (k/v heads repeated up to U).

The whole-model model (`estimate`) adds parameters, gradients and Adam state
(16 bytes per parameter: weights, grads, fp32 master copy or fp32 weights, two
moments), per-layer activations, tensor-parallel all-reduces and the data-parallel
gradient all-reduce (over dp x cp ranks, where gradients are replicated).
It is a model of GPU clusters: only the attention traffic and attention memory
were checked against measurements (on CPU, tests/multiproc/test_bench.py).
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass


FP32 = 4
LSE_BYTES = FP32  # log-sum-exps are kept in fp32 whatever the input dtype
ADAM_BYTES_PER_PARAM = 16


# ---- attention: traffic and memory -------------------------------------------------

def kv_heads_sent(heads, kv_heads, ulysses):
    """K/V heads after Ulysses repeats them so every one of `ulysses` ranks gets one: by the
    smallest factor dividing the GQA group that reaches `ulysses` (attention/ulysses.head_split)."""
    group = heads // kv_heads
    return kv_heads * next((t for t in range(1, group + 1) if group % t == 0 and kv_heads * t >= ulysses), group)


def ring_bytes(batch, seq, kv_heads, head_dim, ring, elem=FP32):
    """Bytes one rank sends in ring attention forward+backward: k/v N-1 hops forward, k/v and
    dk/dv N-1 hops backward, 3(N-1) KV."""
    kv = 2 * batch * (seq // ring) * kv_heads * head_dim * elem
    return 3 * (ring - 1) * kv


def ulysses_bytes(batch, seq, heads, kv_heads, head_dim, ulysses, elem=FP32):
    """Bytes one rank sends in Ulysses forward+backward: 2 x (N-1)/N of q, k, v, out."""
    if ulysses == 1:
        return 0
    local = batch * (seq // ulysses) * head_dim * elem
    sent_heads = 2 * heads + 2 * kv_heads_sent(heads, kv_heads, ulysses)
    return 2 * (ulysses - 1) * local * sent_heads // ulysses


def attention_traffic(batch, seq, heads, kv_heads, head_dim, ring, ulysses, elem=FP32):
    """(Ulysses bytes, ring bytes) per rank for ring x Ulysses context parallelism.

    Ulysses over `ulysses` ranks gathers the sequence s/ring and splits heads;
    the ring then runs over `ring` groups on the head-split k/v (repeated first
    when there are fewer k/v heads than Ulysses ranks).
    """
    inner = ulysses_bytes(batch, seq // ring, heads, kv_heads, head_dim, ulysses, elem)
    ring_heads = kv_heads_sent(heads, kv_heads, ulysses) // ulysses
    return inner, ring_bytes(batch, seq, ring_heads, head_dim, ring, elem)


def degrees(backend, world, ulysses_degree=None):
    """(ring, Ulysses) sizes of `backend` over `world` ranks."""
    if world == 1:
        return 1, 1
    if backend == "p2p":
        return world, 1
    if backend == "all2all":
        return 1, world
    if backend == "hybrid" and ulysses_degree and world % ulysses_degree == 0:
        return world // ulysses_degree, ulysses_degree
    raise ValueError(f"backend {backend!r} over {world} ranks with ulysses_degree={ulysses_degree}: use 'p2p', "
                     "'all2all', or 'hybrid' with a ulysses_degree dividing the ranks")


def attention_bytes(backend, batch, seq, heads, kv_heads, head_dim, world, elem=FP32, ulysses_degree=None):
    """Bytes per rank of `backend` over `world` ranks: the algorithm's minimum, which paddle_cp sends."""
    ring, ulysses = degrees(backend, world, ulysses_degree)
    return sum(attention_traffic(batch, seq, heads, kv_heads, head_dim, ring, ulysses, elem))


def attention_held_bytes(backend, batch, seq, heads, kv_heads, head_dim, world, elem=FP32, ulysses_degree=None):
    """Activation bytes one rank holds between attention forward and backward (inputs included)."""
    _, ulysses = degrees(backend, world, ulysses_degree)
    tokens = batch * seq // world
    qkvo = tokens * (2 * heads + 2 * kv_heads) * head_dim * elem
    lse = tokens * heads * LSE_BYTES
    if ulysses > 1:
        split = tokens * (2 * heads + 2 * kv_heads_sent(heads, kv_heads, ulysses)) * head_dim * elem
        return qkvo + split + lse
    return qkvo + lse


def attention_flops(batch, seq, heads, head_dim, causal):
    """Useful forward+backward FLOPs: 4bhs^2d forward (half if causal), backward 2.5x forward."""
    forward = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return 3.5 * forward


# ---- the whole model --------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Llama-like: GQA attention, SwiGLU MLP, RMSNorm)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} attention heads are not a multiple of {self.kv_heads} k/v heads")

    @classmethod
    def from_config(cls, config):
        """From a PaddleFormers / Hugging Face config.json dict."""
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads, vocab=config["vocab_size"],
            intermediate=config["intermediate_size"], head_dim=config.get("head_dim") or 0,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def layer_matmul_params(self):
        attention = self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        return attention + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self):
        """Parameters that take part in matmuls (the lm_head, not the embedding lookup)."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def params(self):
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        norms = (2 * self.layers + 1) * self.hidden
        return self.layers * self.layer_matmul_params + embeddings + norms


@dataclass(frozen=True)
class Cluster:
    devices: int
    memory: float  # bytes per device
    flops: float  # achievable FLOP/s per device for this model's matmuls
    intra_bandwidth: float  # bytes/s per device within a node
    inter_bandwidth: float  # bytes/s per device across nodes
    devices_per_node: int


@dataclass(frozen=True)
class Layout:
    """Degrees, outermost first: pipeline, data, ring, Ulysses, tensor (tensor innermost: fastest links).
    `micro`: micro-batches per step under the pipeline's 1F1B schedule."""

    dp: int
    ring: int
    ulysses: int
    tp: int
    pp: int = 1
    micro: int = 1

    @property
    def cp(self):
        return self.ring * self.ulysses

    @property
    def backend(self):
        if self.cp == 1:
            return "none"
        if self.ring > 1 and self.ulysses > 1:
            return "hybrid"
        return "all2all" if self.ulysses > 1 else "p2p"

    @property
    def name(self):
        pipeline = f" pp{self.pp} m{self.micro}" if self.pp > 1 else ""
        return f"dp{self.dp} ring{self.ring} uly{self.ulysses} tp{self.tp}{pipeline}"

    @property
    def bubble(self):
        """1F1B's idle share of a step: (p-1)/(m+p-1)."""
        return (self.pp - 1) / (self.micro + self.pp - 1)


def _bandwidth(cluster, stride, size):
    """A group of `size` ranks `stride` apart stays on one node while it spans no more than a node."""
    return cluster.intra_bandwidth if stride * size <= cluster.devices_per_node else cluster.inter_bandwidth


def _all_reduce_bytes(nbytes, size):
    return 2 * (size - 1) * nbytes / size


def stage_params(model, pp):
    """Parameters of the largest pipeline stage: its share of the layers plus the embedding (the first
    stage; with tied embeddings the last stage holds a copy too, untied it holds the lm_head)."""
    embeddings = model.vocab * model.hidden * (1 if model.tied_embeddings else 2)
    if pp == 1:
        return model.params
    return (model.params - embeddings) / pp + model.vocab * model.hidden


def memory(model, layout, seq, batch, elem):
    """Per-rank bytes on the largest (first) stage: parameter state, activations, logits. Under 1F1B the
    first stage holds min(pp, m) micro-batches of its layers' activations; logits one micro-batch."""
    tp, pp = layout.tp, layout.pp
    tokens = batch * seq // layout.cp
    norms = (2 * model.layers + 1) * model.hidden / pp
    params = (stage_params(model, pp) - norms) / tp + norms
    in_flight = min(pp, layout.micro) / layout.micro
    heads, kv_heads = model.heads // tp, max(model.kv_heads // tp, 1)
    attention = attention_held_bytes(layout.backend, batch, seq, heads, kv_heads, model.head_dim, layout.cp, elem,
                                     layout.ulysses)
    # norm outputs and residual (hidden each, twice), MLP gate, up and product (intermediate/tp each)
    rest = tokens * (4 * model.hidden + 3 * model.intermediate // tp) * elem
    logits = tokens * (model.vocab // tp) * FP32
    return {
        "state": ADAM_BYTES_PER_PARAM * params,
        "activations": model.layers / pp * (attention + rest) * in_flight,
        "logits": logits / layout.micro,
    }


def step_time(model, layout, cluster, seq, batch, elem, causal=True):
    """Per-step seconds: compute, then each communication (ring traffic overlaps attention). With a
    pipeline each stage does 1/pp of the layers, stretched by 1F1B's bubble, and sends every
    micro-batch's activations forward and gradients back (2 x tokens x hidden per stage)."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    tokens = batch * seq // cp
    heads, kv_heads = model.heads // tp, max(model.kv_heads // tp, 1)
    dense = 6 * tokens * model.matmul_params / tp
    attention = model.layers * attention_flops(batch, seq, model.heads, model.head_dim, causal) / (cp * tp)
    uly, ring = attention_traffic(batch, seq, heads, kv_heads, model.head_dim, layout.ring, layout.ulysses, elem)
    attention_seconds = attention / cluster.flops
    ring_seconds = model.layers * ring / _bandwidth(cluster, tp * layout.ulysses, layout.ring)
    grad_bytes = (model.params / tp) * elem
    # Megatron tensor parallelism: 2 all-reduces of [tokens, hidden] forward, 2 backward, per layer
    tp_bytes = model.layers * 4 * _all_reduce_bytes(tokens * model.hidden * elem, tp)
    stretch = 1 / (pp * (1 - layout.bubble))  # this stage's share, over the step's busy fraction
    stages_apart = cluster.devices // pp
    return {
        "compute": (dense / cluster.flops + attention_seconds) * stretch,
        "tensor_parallel": tp_bytes / _bandwidth(cluster, 1, tp) * stretch,
        "ulysses": model.layers * uly / _bandwidth(cluster, tp, layout.ulysses) * stretch,
        "ring_exposed": max(0.0, ring_seconds - attention_seconds) * stretch,
        "pipeline_p2p": (2 * tokens * model.hidden * elem / _bandwidth(cluster, stages_apart, 2)) if pp > 1 else 0.0,
        "grad_all_reduce": _all_reduce_bytes(grad_bytes / pp, layout.dp * cp) / _bandwidth(cluster, tp, layout.dp * cp),
    }


def layouts(model, devices, seq, max_tp, batch=1):
    """Every pp x dp x ring x Ulysses x tp factorisation of `devices` that can run; a pipeline takes
    one sequence per micro-batch (m = batch)."""
    for pp, tp, ulysses, ring in itertools.product(_divisors(devices), repeat=4):
        dp, rest = divmod(devices, pp * tp * ulysses * ring)
        # Heads and tokens need not divide (the busiest rank then has one more; the model uses the mean),
        # but every Ulysses rank needs a head, every context-parallel rank a token, every stage a layer.
        if (rest or tp > max_tp or model.heads % tp or model.heads // tp < ulysses or seq < ring * ulysses
                or model.layers < pp):
            continue
        yield Layout(dp, ring, ulysses, tp, pp, batch if pp > 1 else 1)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate(model, layout, cluster, seq, batch=1, elem=2, causal=True):
    """One layout's memory, time and throughput (`batch` sequences per data-parallel replica)."""
    mem = memory(model, layout, seq, batch, elem)
    time = step_time(model, layout, cluster, seq, batch, elem, causal)
    total_mem, total_time = sum(mem.values()), sum(time.values())
    return {
        "layout": asdict(layout), "name": layout.name, "backend": layout.backend,
        "memory": mem, "memory_total": total_mem, "fits": total_mem <= cluster.memory,
        "time": time, "step_time": total_time,
        "tokens_per_second": layout.dp * batch * seq / total_time,
    }


def rank_layouts(model, cluster, seq, batch=1, elem=2, causal=True):
    """Estimates of every candidate, best first: layouts that fit, by throughput, then the rest by memory."""
    found = [estimate(model, layout, cluster, seq, batch, elem, causal)
             for layout in layouts(model, cluster.devices, seq, cluster.devices_per_node, batch)]
    return sorted(found, key=lambda e: (not e["fits"], -e["tokens_per_second"] if e["fits"] else e["memory_total"]))


def parallelize_config(layout, model_prefix="model"):
    """The YAML-able config (see paddle_cp.api.config.load_config) that runs `layout`."""
    dims = [(name, size) for name, size in (("pp", layout.pp), ("dp", layout.dp), ("sep", layout.cp), ("mp", layout.tp))
            if size > 1]
    dims = dims or [("dp", 1)]
    config = {"mesh": {"shape": [s for _, s in dims], "dim_names": [n for n, _ in dims]},
              "dp_config": {"sharding_level": 0}}
    layers = f"{model_prefix}.layers.*"
    if layout.pp > 1:  # PaddleFormers computes its rotary tables before the layer loop
        config["pp_config"] = {"split_spec": f"{model_prefix}.layers", "global_spec": f"{model_prefix}.rotary_emb",
                               "schedule_mode": "1F1B", "accumulate_steps": layout.micro}
    if layout.tp > 1:
        plan = {f"{layers}.self_attn.{p}_proj": "ColWiseParallel" for p in "qkv"}
        plan[f"{layers}.self_attn.o_proj"] = "RowWiseParallel"
        plan.update({f"{layers}.mlp.{p}_proj": "ColWiseParallel" for p in ("gate", "up")})
        plan[f"{layers}.mlp.down_proj"] = "RowWiseParallel"
        config["mp_config"] = {"parallelize_plan": plan}
    if layout.cp > 1:
        args = {"backend": layout.backend}
        if layout.backend == "hybrid":
            args["ulysses_degree"] = layout.ulysses
        config["cp_config"] = {"parallelize_plan": {
            model_prefix: {"PrepareContextParallel": dict(args)},
            f"{layers}.self_attn": [{"ContextParallel": dict(args)}],
        }}
    return config
