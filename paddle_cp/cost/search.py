"""The layout search behind `pcp-plan`: every layout paddle_cp can run on a cluster, estimated and ranked
(pure functions, no Paddle, no devices).

A candidate is a pipeline x data x ring x Ulysses x tensor factorisation of the devices (tensor parallel
within a node, with sequence parallelism), an interleaved pipeline or not, an expert-parallel degree (MoE
models: dividing dp x sep), a sharding level over dp x sep, recomputation (none, full, or the selective
modules the model's family reads), an unchunked or chunked loss, MLPs tiled over the sequence or not (dense
models), full recomputation's layer inputs in host memory or not, the optimizer stepped on the host or not.
Each gets memory.memory (bytes per rank, the busiest stage's peak; its host bytes per node, layer inputs
and optimizer state, within the cluster's host memory), step_time.step_time and step_time.attention_bytes (the
bytes a rank receives per layer for attention, within a node and across nodes); those that fit (the peak within
the device's memory less the cluster's reserve) come first, fastest first, then the rest by memory.
`longest_sequence` bisects for the longest sequence some layout fits (`pcp-plan --max-seq`), `longest_video` for
the longest video a vision-language model's layouts fit (its tokens the sequence; `pcp-plan --max-seq` with a
video).

Not proposed: recomputation on a pipeline and a chunked loss with tensor parallelism (both run, but the
estimates do not model them yet: the chunked loss under tp computes the whole head on every rank), an
interleaved pipeline whose micro-batches are not a multiple of the stages or whose stages' layers the
chunks do not divide.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict

from .memory import memory, stage_layers
from .candidate import NO_RECOMPUTE, RECOMPUTE_FULL, Layout
from .step_time import attention_bytes, ring_exchange, step_time
from .vision_language import VisionBatch
from .vision_shape import media_tokens

DEFAULT_LOSS_CHUNK = 4096  # tokens per chunk of the chunked loss the search tries
DEFAULT_MLP_TILE = 4096  # tokens per SequenceTiled tile the search tries (ALST: about the hidden size)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def recompute_options(model, pp):
    options = [NO_RECOMPUTE]
    if pp == 1:
        options.append(RECOMPUTE_FULL)
        options += [m for m in ("core_attn", "full_attn", "mlp") if m in model.selective_modules]
        if {"full_attn", "mlp"} <= set(model.selective_modules):
            options.append("full_attn+mlp")
    return options


def _vpp_options(model, pp, micro):
    if pp == 1:
        return [1]
    return [v for v in (1, 2) if v == 1 or (micro % pp == 0 and all(
        stage_layers(model, pp, s) % v == 0 for s in range(pp)))]


def _memory_options(model, recompute, tokens, mlp_tile, offload, offload_optimizer):
    """(mlp_tile, offload, offload_optimizer) triples: tiles where a rank has more tokens than a tile and no layer
    is MoE (SequenceTiled refuses MoE blocks); host offload of full recomputation's inputs (if `offload`); the
    optimizer stepped on the host (if `offload_optimizer`)."""
    tiles = [0] + ([mlp_tile] if mlp_tile and not model.moe_layers and tokens > mlp_tile else [])
    offloads = [False, True] if recompute == RECOMPUTE_FULL and offload else [False]
    host_steps = [False, True] if offload_optimizer else [False]
    return list(itertools.product(tiles, offloads, host_steps))


def candidates(model, devices, seq, max_tp, batch=1, loss_chunk=DEFAULT_LOSS_CHUNK, mlp_tile=DEFAULT_MLP_TILE,
               offload=True, offload_optimizer=True):
    """Every layout of `devices` paddle_cp can run for `model` at `seq` tokens, `batch` sequences per replica
    (a pipeline takes one sequence per micro-batch: m = batch)."""
    for pp, tp, ulysses, ring in itertools.product(_divisors(devices), repeat=4):
        dp, rest = divmod(devices, pp * tp * ulysses * ring)
        # Heads and tokens need not divide (the busiest rank then has one more; the model uses the mean),
        # but every Ulysses rank needs a head, every context-parallel rank a token, every stage a layer, and tp
        # must divide the k/v heads (paddle_cp refuses otherwise).
        if (rest or tp > max_tp or model.kv_heads % tp or model.heads // tp < ulysses or seq < ring * ulysses
                or model.layers < pp):
            continue
        if model.vision and (tp > 1 or pp > 1):  # paddle_cp runs a vision-language model on dp x sep alone
            continue
        cp, micro = ring * ulysses, batch if pp > 1 else 1
        replicas = dp * cp
        experts = [e for e in _divisors(replicas) if e <= model.experts] if model.experts else [1]
        chunks = [0] + ([loss_chunk] if tp == 1 and loss_chunk < batch * seq / cp / micro else [])
        for vpp, ep, level, recompute, chunk in itertools.product(
                _vpp_options(model, pp, micro), experts, range(4) if replicas > 1 else [0],
                recompute_options(model, pp), chunks):
            for tile, host, host_step in _memory_options(model, recompute, batch * seq / cp / micro, mlp_tile,
                                                         offload, offload_optimizer):
                yield Layout(dp=dp, ring=ring, ulysses=ulysses, tp=tp, pp=pp, micro=micro, vpp=vpp, ep=ep,
                             sharding=level, recompute=recompute, loss_chunk=chunk, mlp_tile=tile, offload=host,
                             offload_optimizer=host_step)


def estimate(model, layout, cluster, seq, batch=1, elem=2, causal=True, fused=False, packed=None, master_grad=True,
             vision=None):
    """One layout's memory, time and throughput (`batch` sequences per data-parallel replica; `packed`: an
    attention.PackedRow of the sequences' documents; `elem` and `master_grad`: the precision, by default
    PaddleFormers' bf16 O2 with fp32 master gradients; `vision`: a vision_language.VisionBatch, each sequence's
    media and how the tower runs)."""
    mem = memory(model, layout, seq, batch, elem, fused, master_grad, vision)
    exchange = ring_exchange(model, layout, cluster, seq, batch, elem, causal, packed)
    time = step_time(model, layout, cluster, seq, batch, elem, causal, packed, master_grad, exchange, vision)
    total_time = sum(time.values())
    host_per_node = mem["host"] * min(cluster.devices, cluster.devices_per_node)
    return {
        "layout": asdict(layout), "name": layout.name, "backend": layout.backend,
        "memory": mem, "memory_total": mem["peak"], "host_per_node": host_per_node,
        "fits": mem["peak"] <= cluster.usable_memory and host_per_node <= cluster.host_memory,
        "time": time, "step_time": total_time,
        "attention_bytes": attention_bytes(model, layout, cluster, seq, batch, elem, exchange=exchange),
        "tokens_per_second": layout.dp * batch * seq / total_time,
    }


# Memory savers in the order they are given up: the host optimizer first (a step on the host's cores, host memory
# for the whole optimizer state), then tiled MLPs and offloaded activations.
LAST_RESORTS = (("offload_optimizer",), ("mlp_tile", "offload"))


def rank_layouts(model, cluster, seq, batch=1, elem=2, causal=True, loss_chunk=DEFAULT_LOSS_CHUNK,
                 mlp_tile=DEFAULT_MLP_TILE, fused=False, offload=True, packed=None, offload_optimizer=True,
                 master_grad=True, vision=None):
    """Estimates of every candidate, best first: layouts that fit, by throughput (then the least memory), then the
    rest by memory. Each group of LAST_RESORTS is kept only where no layout fits without it: tiles and offloaded
    activations buy length with an extra MLP forward, host memory and PCIe traffic (whose contention with the
    rest of the step the model does not count), the host optimizer with a slower step and more host memory."""
    found = [estimate(model, layout, cluster, seq, batch, elem, causal, fused, packed, master_grad, vision)
             for layout in candidates(model, cluster.devices, seq, cluster.devices_per_node, batch, loss_chunk,
                                      mlp_tile, offload, offload_optimizer)]
    for features in LAST_RESORTS:
        if any(e["fits"] and not _uses(e, features) for e in found):
            found = [e for e in found if not _uses(e, features)]
    return sorted(found, key=lambda e: (not e["fits"], -e["tokens_per_second"] if e["fits"] else 0, e["memory_total"]))


def _uses(estimate, features):
    return any(estimate["layout"][feature] for feature in features)


def longest(fitting):
    """(the largest number of units n >= 1 for which `fitting(n)` (ranked estimates, or None when nothing fits)
    is not None, its estimates); (0, []) if not even one unit fits. Bisection: memory grows with the units."""
    best = fitting(1)
    if best is None:
        return 0, []
    lo, hi = 1, 2
    while (found := fitting(hi)) is not None:
        lo, hi, best = hi, hi * 2, found
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = fitting(mid)
        lo, hi, best = (mid, hi, found) if found is not None else (lo, mid, best)
    return lo, best


def _fits(ranked):
    return ranked if ranked and ranked[0]["fits"] else None


def longest_sequence(model, cluster, granularity, batch=1, elem=2, causal=True, loss_chunk=DEFAULT_LOSS_CHUNK,
                     mlp_tile=DEFAULT_MLP_TILE, fused=False, offload=True, offload_optimizer=True, master_grad=True):
    """(the longest multiple of `granularity` tokens some layout fits, its ranked estimates); (0, []) if none fits
    even `granularity` tokens."""
    units, best = longest(lambda units: _fits(rank_layouts(
        model, cluster, units * granularity, batch, elem, causal, loss_chunk, mlp_tile, fused, offload,
        offload_optimizer=offload_optimizer, master_grad=master_grad)))
    return units * granularity, best


def longest_video(model, cluster, media_of, text_tokens, mode="whole", **options):
    """(the most temporal patches n of a video some layout fits, its ranked estimates): `media_of(n)` gives a
    sequence's media (vision_shape.Media) with n temporal patches of video, the sequence its tokens and
    `text_tokens` more, the tower run `mode` (vision_language.MODES), `options` rank_layouts'; (0, []) if not even
    one fits."""
    def fitting(units):
        media = media_of(units)
        return _fits(rank_layouts(model, cluster, media_tokens(model.vision, media) + text_tokens,
                                  vision=VisionBatch(media, mode), **options))

    return longest(fitting)
