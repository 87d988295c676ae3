"""The layout search behind `pcp-plan`: every layout paddle_cp can run on a cluster, estimated and ranked
(pure functions, no Paddle, no devices).

A candidate is a pipeline x data x ring x Ulysses x tensor factorisation of the devices (tensor parallel
within a node, with sequence parallelism), an interleaved pipeline or not, an expert-parallel degree (MoE
models: dividing dp x sep), a sharding level over dp x sep, recomputation (none, full, or the selective
modules the model's family reads) and an unchunked or chunked loss. Each gets memory_model.memory (bytes
per rank, the busiest stage's peak) and step_time.step_time; those that fit the device memory come first,
fastest first, then the rest by memory.

Not proposed: recomputation on a pipeline and a chunked loss with tensor parallelism (both run, but the
estimates do not model them yet: the chunked loss under tp computes the whole head on every rank), an
interleaved pipeline whose micro-batches are not a multiple of the stages or whose stages' layers the
chunks do not divide.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict

from .memory_model import memory, stage_layers
from .plan_layout import NO_RECOMPUTE, RECOMPUTE_FULL, Layout
from .step_time import step_time

DEFAULT_LOSS_CHUNK = 4096  # tokens per chunk of the chunked loss the search tries


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


def candidates(model, devices, seq, max_tp, batch=1, loss_chunk=DEFAULT_LOSS_CHUNK):
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
        cp, micro = ring * ulysses, batch if pp > 1 else 1
        replicas = dp * cp
        experts = [e for e in _divisors(replicas) if e <= model.experts] if model.experts else [1]
        chunks = [0] + ([loss_chunk] if tp == 1 and loss_chunk < batch * seq / cp / micro else [])
        for vpp, ep, level, recompute, chunk in itertools.product(
                _vpp_options(model, pp, micro), experts, range(4) if replicas > 1 else [0],
                recompute_options(model, pp), chunks):
            yield Layout(dp=dp, ring=ring, ulysses=ulysses, tp=tp, pp=pp, micro=micro, vpp=vpp, ep=ep,
                         sharding=level, recompute=recompute, loss_chunk=chunk)


def estimate(model, layout, cluster, seq, batch=1, elem=2, causal=True, packed=None):
    """One layout's memory, time and throughput (`batch` sequences per data-parallel replica; `packed`: an
    attention_cost.PackedRow of the sequences' documents)."""
    mem = memory(model, layout, seq, batch, elem)
    time = step_time(model, layout, cluster, seq, batch, elem, causal, packed)
    total_time = sum(time.values())
    return {
        "layout": asdict(layout), "name": layout.name, "backend": layout.backend,
        "memory": mem, "memory_total": mem["peak"], "fits": mem["peak"] <= cluster.memory,
        "time": time, "step_time": total_time,
        "tokens_per_second": layout.dp * batch * seq / total_time,
    }


def rank_layouts(model, cluster, seq, batch=1, elem=2, causal=True, loss_chunk=DEFAULT_LOSS_CHUNK, packed=None):
    """Estimates of every candidate, best first: layouts that fit, by throughput (then the least memory), then the
    rest by memory."""
    found = [estimate(model, layout, cluster, seq, batch, elem, causal, packed)
             for layout in candidates(model, cluster.devices, seq, cluster.devices_per_node, batch, loss_chunk)]
    return sorted(found, key=lambda e: (not e["fits"], -e["tokens_per_second"] if e["fits"] else 0, e["memory_total"]))
