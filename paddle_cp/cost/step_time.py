"""Seconds per training step of a planned layout on a GPU cluster (pure functions, a model, not a measurement).

Matmuls at the cluster's GEMM rate, attention at its attention rate (an H200 measured bf16 GEMM at 695-772
TFLOP/s at Llama-8B shapes, causal attention forward + backward at 287-328 with FlashAttention-2 and 544-577
with cuDNN: docs/long_context.md); each communication at the bandwidth of the links its group spans (a group
of `size` ranks `stride` apart stays on one node while stride x size <= devices per node; the ring's exchange
member by member on its own links); ring traffic hidden behind attention compute, the rest not overlapped. What each term counts:

- compute: 6 FLOPs per active matmul parameter per token (the lm_head included, top-k experts only) and
  attention.attention_flops, over tp and cp (on packed documents, attention at the GPU tile model's
  seconds instead: attention.PackedRow, the slowest rank in the layout paddle_cp chooses); recomputation
  adds its forward again (full: the layer; selective: attention's or the MLP's share); a chunked loss recomputes the lm_head forward. A pipeline
  stage does 1/pp of it, stretched by the schedule's bubble.
- tensor_parallel: sequence parallelism's all-gather and reduce-scatter around attention and the MLP, forward
  and backward (the volume of Megatron's two all-reduces per layer each way).
- ulysses: attention.py's all-to-all traffic.
- ring_exposed: the planned k/v exchange paddle_cp runs (planned_exchange.py), per layer forward + backward the
  k/v rows other members' tiles read, twice, and their fp32 gradients home (exchange.py), for one causal document
  in 2R chunks or a PackedRow's chosen layout; each member's bytes at the rate of the link they come over
  (NVLink within a node, the network across: links.LinkCost on the cluster's rates and nodes), the busiest
  member's; hidden behind the layer's attention compute (forward + backward, and the replayed forward where
  recomputation replays attention: the k/v's second pass is then the replay's, whose rows the backward reads,
  not a fetch in backward; past exchange.REPLAY_HOLD_LIMIT the backward fetches them a third time): only the
  part longer than it shows.
- pipeline_p2p: every micro-batch's activations forward and gradients back, once per chunk (interleaved).
- expert_all_to_all: each MoE layer sends its tokens' top-k copies to their experts and back, forward and
  backward: 4 k t h bytes x (E-1)/E.
- sequence tiles: a SequenceTiled MLP's forward runs once more (its backward replays each tile).
- host_offload_exposed: offloaded layer inputs go to the host during each layer's forward and come back
  (prefetched) during the previous layer's backward, on a side stream: per layer, the part of a copy longer
  than that layer's compute in the same pass shows.
- gradients: paddle_cp's reduction over the sharding ranks: level 0 an all-reduce, 1 an all-reduce then the
  owners' broadcast of new values, 2 a reduce-scatter then the broadcast, 3 a reduce-scatter and every
  parameter fetched from its owner for the forward and again for the backward (and the recomputed forward);
  gradients in fp32 under master gradients (memory.gradient_elem), values in the parameters' dtype.
- vision_compute, feature_exchange: a vision-language model's tower on its busiest rank and the split's features
  to their owners (vision_seconds).
- host_optimizer: the step on the host (dp_config offload_optimizer): the stepped share's gradients to the
  host (fp32 parameters their values too) and new values back, fp32 (cast on the device), at the PCIe rate,
  the host's AdamW at `host_adamw_rate`, not overlapped.
"""
from __future__ import annotations

import numpy as np

from .attention import FP32, attention_flops, attention_traffic, ring_kv_heads
from .exchange import chunk_reads, link_bytes, received_rows, replay_holds
from .links import LinkCost, Links
from .memory import gradient_elem, recompute_inputs, replays_attention, stage_params, stepped_params
from .candidate import NO_RECOMPUTE, RECOMPUTE_FULL
from .vision_language import exchange_bytes
from .vision_tower import attention_seconds, matmul_flops


def _bandwidth(cluster, stride, size):
    return cluster.intra_bandwidth if stride * size <= cluster.devices_per_node else cluster.inter_bandwidth


def _ring_share(size):
    """Bytes each rank sends per byte of the reduced buffer: (n-1)/n (an all-reduce is twice that)."""
    return (size - 1) / size


def _recompute_factor(layout, attention_share):
    """Forward-pass share of a step that recomputation adds (forward = 1/3 of forward + backward)."""
    if layout.recompute == NO_RECOMPUTE:
        return 0.0
    if layout.recompute == RECOMPUTE_FULL:
        return 1 / 3
    share = (attention_share if replays_attention(layout) else 0) + (
        1 - attention_share if "mlp" in layout.selective else 0)
    return share / 3


def step_time(model, layout, cluster, seq, batch, elem, causal=True, packed=None, master_grad=True, exchange=None,
              vision=None):
    """{term: seconds} of one step (`batch` sequences of `seq` per data-parallel replica); `packed`: an
    attention.PackedRow when the sequences pack documents; `master_grad`: fp32 gradients below fp32; `exchange`:
    the layout's RingExchange where the caller has it (ring_exchange's); `vision`: a VisionBatch (a
    vision-language model's media: vision_seconds)."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    tokens = batch * seq / cp  # per rank, all micro-batches
    heads, kv_heads = model.heads // tp, model.kv_heads // tp
    dense_flops = 6 * tokens * model.active_matmul_params / tp
    attention = model.layers * batch * attention_flops(1, seq, model.heads, model.head_dim, causal) / (cp * tp)
    total = dense_flops + attention
    factor = _recompute_factor(layout, attention / total)
    recompute_dense, recompute_attention = factor * dense_flops, factor * attention
    if layout.loss_chunk:
        recompute_dense += 2 * tokens * model.embedding_params / tp
    if layout.mlp_tile:
        recompute_dense += 2 * tokens * model.dense_layers * model.dense_mlp_params / tp
    stretch = 1 / (pp * (1 - layout.bubble))  # this stage's share, over the step's busy fraction
    uly, _ = attention_traffic(batch, seq, heads, kv_heads, model.head_dim, layout.ring, layout.ulysses, elem)
    attention_seconds = attention / cluster.attention_rate
    if packed is not None:  # tiles, not FLOPs: the layout's slowest rank at the tile model's rates (fwd + bwd)
        attention_seconds = model.layers * batch * packed.seconds(layout.ring, layout.ulysses, heads, model.head_dim,
                                                                  ring_links(cluster, layout))
    gemm_seconds = dense_flops / cluster.flops
    if exchange is None:
        exchange = ring_exchange(model, layout, cluster, seq, batch, elem, causal, packed)
    ring_seconds = model.layers * exchange.seconds
    tp_bytes = model.layers * 4 * 2 * _ring_share(tp) * tokens * model.hidden * elem
    expert_bytes = (model.moe_layers * 4 * model.experts_per_token * tokens / tp * model.hidden * elem
                    * _ring_share(layout.ep))
    dp_stride = tp * cp
    times = {
        "compute": ((dense_flops + recompute_dense) / cluster.flops + attention_seconds
                    + recompute_attention / cluster.attention_rate) * stretch,
        "host_offload_exposed": _offload_exposed(model, layout, cluster, tokens, elem,
                                                 (gemm_seconds + attention_seconds) / model.layers) * stretch,
        "tensor_parallel": tp_bytes / _bandwidth(cluster, 1, tp) * stretch,
        "ulysses": model.layers * uly / _bandwidth(cluster, tp, layout.ulysses) * stretch,
        # the exchange beside the attention that runs: forward + backward, the replayed forward (a third) too
        "ring_exposed": max(0.0, ring_seconds - attention_seconds * (4 / 3 if replays_attention(layout) else 1))
                        * stretch,
        "pipeline_p2p": (2 * layout.vpp * tokens * model.hidden * elem / _bandwidth(cluster, cluster.devices // pp, 2)
                         if pp > 1 else 0.0),
        "expert_all_to_all": expert_bytes / _bandwidth(cluster, tp, layout.ep) * stretch if layout.ep > 1 else 0.0,
        "gradients": _gradient_seconds(model, layout, cluster, elem, gradient_elem(elem, master_grad), dp_stride),
        "host_optimizer": host_optimizer_seconds(model, layout, cluster, elem),
        **vision_seconds(model, layout, cluster, seq, batch, elem, vision),
    }
    return times


def vision_seconds(model, layout, cluster, seq, batch, elem, vision):
    """{"vision_compute", "feature_exchange"}: the tower's forward + backward on the rank computing the most patches
    (every patch on every rank under `whole`, the largest share under `split`), its matmuls at the GEMM rate and its
    attention on the tile model, a recomputed forward again under full recomputation; on the first stage, behind
    nothing. The split's features to their positions' owners and their gradients back (one all-to-all each way
    over the sep group), not overlapped."""
    if vision is None or not model.vision:
        return {"vision_compute": 0.0, "feature_exchange": 0.0}
    computed = vision.computed(model, layout, seq, elem)
    recompute = 4 / 3 if layout.recompute == RECOMPUTE_FULL else 1
    seconds = recompute * (3 * matmul_flops(model.vision, computed) / cluster.flops
                           + attention_seconds(model.vision, computed))
    exchanged = exchange_bytes(model, layout, seq, elem, vision)
    return {"vision_compute": batch * seconds,
            "feature_exchange": batch * exchanged / _bandwidth(cluster, layout.tp, layout.cp)}


def ring_links(cluster, layout):
    """links.LinkCost of a replica's ring: member g's ranks from g x U x tp on (tensor and Ulysses inside it), nodes
    of `devices_per_node` ranks, the cluster's rates."""
    rates = Links(ranks_per_node=cluster.devices_per_node, intra_gbps=cluster.intra_bandwidth / 1e9,
                  inter_gbps=cluster.inter_bandwidth / 1e9)
    return LinkCost.of_ranks(np.arange(layout.ring) * layout.ulysses * layout.tp, rates)


class RingExchange:
    """The planned exchange of one layer's forward + backward on the ring member whose exchange takes longest:
    `seconds` on its links, `within_node` and `across_nodes` the bytes it receives over each (what the others
    send it; links are full duplex)."""

    def __init__(self, seconds=0.0, within_node=0, across_nodes=0):
        self.seconds, self.within_node, self.across_nodes = seconds, int(within_node), int(across_nodes)


def ring_exchange(model, layout, cluster, seq, batch, elem, causal=True, packed=None):
    """RingExchange of `layout`'s ring on the cluster's links (ring_links): the k/v rows other members' tiles read
    (exchange.chunk_reads for one document in 2R chunks; a PackedRow's chosen layout's TileCounts.read), `batch`
    rows of them, k/v in `elem` bytes, their gradients fp32 (rotation.GRAD_DTYPE); a hybrid rank's share of
    its ring group's heads; under recomputation of attention, whether its replay holds what it received is
    decided from those rows, as the ring decides (exchange.replay_holds)."""
    if layout.ring == 1:
        return RingExchange()
    links = ring_links(cluster, layout)
    heads = ring_kv_heads(model.heads // layout.tp, model.kv_heads // layout.tp, layout.ulysses)
    row = batch * heads * 2 * model.head_dim  # k and v of one token on one rank
    read = (chunk_reads(seq, layout.ring, causal) if packed is None
            else packed.counts(layout.ring, layout.ulysses, links).read)
    received_by_call = int(received_rows(read).max()) * row // layout.micro * elem  # a call's: one micro-batch's
    refetched = replays_attention(layout) and not replay_holds(received_by_call)
    received = link_bytes(read, row * elem, row * FP32, 3 if refetched else 2)  # [R, R]: what member r receives from g
    seconds = links.link_seconds(received)
    busiest = int(np.argmax(seconds))
    within, across = links.by_link(received)
    return RingExchange(float(seconds[busiest]), within[busiest], across[busiest])


def attention_bytes(model, layout, cluster, seq, batch, elem, causal=True, packed=None, exchange=None):
    """{link: bytes} one rank receives per layer (forward + backward of `batch` sequences) for attention: the
    ring's planned exchange (its busiest member's; `exchange`: ring_exchange's where the caller has it) and
    Ulysses' all-to-alls, within a node and across nodes."""
    heads, kv_heads = model.heads // layout.tp, model.kv_heads // layout.tp
    uly, _ = attention_traffic(batch, seq, heads, kv_heads, model.head_dim, layout.ring, layout.ulysses, elem)
    uly_across = layout.tp * layout.ulysses > cluster.devices_per_node  # _bandwidth's test
    ring = exchange if exchange is not None else ring_exchange(model, layout, cluster, seq, batch, elem, causal, packed)
    return {"ring_within_node": ring.within_node, "ring_across_nodes": ring.across_nodes,
            "ulysses_within_node": 0 if uly_across else int(uly), "ulysses_across_nodes": int(uly) if uly_across else 0}


def host_optimizer_seconds(model, layout, cluster, elem):
    """A step on the host (dp_config offload_optimizer), after the gradients' reduction: the rank's stepped
    share of gradients out (cast to fp32 on the device; an fp32 parameter, which keeps no master on the host,
    its value too), the host's AdamW over it, the new fp32 values back (cast on the device), one after the other
    and behind nothing (backward is over; the next forward needs the values)."""
    if not layout.offload_optimizer:
        return 0.0
    params = stepped_params(model, layout, 0)
    copies = 3 if elem >= FP32 else 2
    return copies * params * FP32 / cluster.pcie_bandwidth + params / cluster.host_adamw_rate


def _offload_exposed(model, layout, cluster, tokens, elem, layer_seconds):
    """Copy time not hidden behind compute: per layer, its inputs out during its forward (a third of the
    layer's forward + backward) and back during the previous layer's backward and recomputed forward."""
    if not layout.offload:
        return 0.0
    copy = recompute_inputs(model, layout, tokens, elem) / cluster.pcie_bandwidth
    return model.layers * (max(0.0, copy - layer_seconds / 3) + max(0.0, copy - layer_seconds))


def _gradient_seconds(model, layout, cluster, elem, grad_elem, stride):
    """The first stage's gradient reduction (experts' over their own ranks, dp x sep / ep): passes over the
    gradients (an all-reduce two, a reduce-scatter one) and over the values (broadcasts, fetches)."""
    ranks = layout.shard_ranks
    dense, experts = stage_params(model, layout, 0)
    gradient_passes = {0: 2, 1: 2, 2: 1, 3: 1}[layout.sharding]
    value_passes = {0: 0, 1: 1, 2: 1, 3: 2 + (layout.recompute != NO_RECOMPUTE)}[layout.sharding]
    per_element = gradient_passes * grad_elem + value_passes * elem
    seconds = 0.0
    for params, size in ((dense, ranks), (experts, max(1, ranks // layout.ep))):
        if size > 1 and params:
            seconds += params * per_element * _ring_share(size) / _bandwidth(cluster, stride, size)
    return seconds
