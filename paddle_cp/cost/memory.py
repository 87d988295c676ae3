"""Per-rank memory of a training step under a planned layout (pure functions, no Paddle).

Everything is bytes on one rank of the busiest pipeline stage (the first: embedding and the most
in-flight micro-batches; or the last: lm_head and the loss), counted as PaddleFormers' eager Llama
path and paddle_cp hold it:

- weights, gradients, optimizer: a stage's parameters, split by tensor parallelism (projections, embedding,
  lm_head; norms, routers and MoE blocks' shared and routed experts stay whole) and expert parallelism
  (routed experts / ep); AdamW keeps two fp32 moments and, below fp32, an fp32 master copy. Gradients are
  fp32 master gradients below fp32 (`master_grad`, PaddleFormers' amp_master_grad default: Paddle casts them
  at the end of backward, paddle_cp accumulates and reduces them in fp32), else the parameter's dtype. Sharding
  divides, over the layout's `shard_ranks` (dp x sep by default; experts over those / ep):
  optimizer state at levels 1-3, gradients after the step's reduction at levels 2-3, weights at level 3.
  `offload_optimizer` (data_parallel/host_optimizer.py): that state (moments, and below fp32 the master) lives in
  host memory (`host`), stepped there (an fp32 parameter is stepped on a transient host copy); the device holds,
  during the step, one parameter's new value on its way back (fp32, and its cast to the parameter's dtype).
  paddle_cp gives each parameter one owner, so the busiest rank holds its share or the largest parameter,
  whichever is more (greedy owners, largest first: at most one parameter over that).
- activations (per layer and micro-batch, t tokens per rank, SP region t/tp): two RMSNorms, each its input
  and normalized value (fp32 input copy below fp32) at t/tp and its output at t; RoPE's q and k and their
  rotated halves (fp32); attention's q, k, v, output and fp32 log-sum-exp (attention.attention_held_bytes,
  Ulysses' head-split copies included); the MLP's gate, up, activation and product (4 x intermediate/tp);
  MoE layers MOE_TENSORS_PER_EXPERT_WIDTH expert-width tensors per top-k copy, the routing bookkeeping
  (MOE_ROUTER_BYTES_PER_EXPERT per expert), the shared experts' four. Full recomputation keeps each layer's input and the rotary tables it is called with,
  and rebuilds one layer in backward; selective recomputation drops what its modules hold. A replayed ring
  attention also holds the k/v rows its forward received until its backward (the busiest member's, one causal
  document in 2R chunks, up to exchange.REPLAY_HOLD_LIMIT: `ring_replay_held`). Plus the final
  norm. Under a pipeline the first stage holds 1F1B's min(m, p) micro-batches (interleaved: its warm-up's
  chunks).
- long sequences (docs/long_sequences.md): a SequenceTiled MLP keeps its input alone, its backward adds one tile's
  four tensors and MLP_GRADIENT_TENSORS gradients and the [t, h] input gradient (an untiled MLP's backward adds
  MLP_GRADIENT_TENSORS [t, intermediate] gradients); OffloadRecomputeInputs moves full recomputation's kept inputs
  to the host (`host`) and adds a layer's own and the next layer's (prefetched) to its backward. `fused`: GPU
  kernels' activations (fused RMSNorm: input and fp32 inverse rms; fused RoPE: no fp32 copies), from their op
  contracts, not measured: True for both, or the FUSED_KERNELS named (PaddleFormers 1.2.0's Llama calls the
  fused RMSNorm on GPU unless its config sets fuse_rms_norm=False, and rotates q and k with eager fp32 ops).
- logits: the [t, vocab/tp] fp32 logits at the end of the forward; the loss backward adds two more.
  Chunked (PaddleFormers' fused head + loss): nothing at the end of the forward, and its backward holds
  CHUNK_TEMPORARIES [chunk, vocab/tp] fp32 tensors and HEAD_WEIGHT_COPIES of the lm_head weight (fp32).
- gradients reduced in buckets (data_parallel/buckets.py, BUCKET_BYTES each, as the last backward writes
  them): at levels 2-3 a rank holds, during its layers' backward, the share it owns plus about a bucket not
  yet reduced (whole gradients under a pipeline, whose buckets wait for the step, and at levels 0-1); the
  reduction holds those gradients plus BUCKET_COPIES buckets (a bucket's flat buffer and its pieces).

- a vision-language model (cost/vision_language.py, on the first stage): its tower's parameters with the stage's
  (not split over tp), the tower's activations and the merge's kept to the tower's backward (every micro-batch in
  flight) and the batch's pixel values, in every phase; the tower's backward a phase of its own: the decoder's
  activations gone, the gradients held, the merged embeddings' two gradients and the features' (or, recomputed,
  the features' and a rebuilt block with MLP_GRADIENT_TENSORS [patches, intermediate] gradients); the batch check's
  fingerprint of the pixel values a phase too, at the forward's start.

peak = max(loss backward: weights + optimizer + activations + 3 x logits (or the chunked loss's temporaries),
           layer backward: weights + optimizer + max(activations, held gradients) + a recomputed layer + level
           3's fetched parameter, step: weights + optimizer + held gradients + BUCKET_COPIES x a bucket
           [, vision backward, batch check]).
The constants were measured on CPU, fp32, with `pcp-memory` (Paddle 3.3.1, PaddleFormers 1.2.0): the
activation inventory within 1% of PaddleFormers' Llama per layer; the rest checked by `pcp-memory --layouts`
(docs/tools.md gives the table). Fused GPU kernels (RMSNorm, SwiGLU) hold less: there it is an upper bound.
"""
from __future__ import annotations

from .attention import FP32, attention_held_bytes, ring_kv_heads
from .candidate import NO_RECOMPUTE, RECOMPUTE_FULL
from .exchange import chunk_reads, received_rows, replay_holds
from .rms_norm import rms_norm_kept
from .vision_language import NO_VISION, batch_check_bytes, vision_terms

MOMENTS_BYTES = 2 * FP32  # AdamW's two moments per parameter, fp32
CHUNK_TEMPORARIES = 6  # [chunk, vocab] fp32 tensors PaddleFormers' fused head + loss holds at once in backward
HEAD_WEIGHT_COPIES = 5  # lm_head-sized fp32 tensors it holds then (per-chunk weight gradients and their sum)
LOSS_BACKWARD_LOGITS = 2  # [t, vocab] fp32 tensors the unchunked loss backward adds to the logits
MLP_GRADIENT_TENSORS = 2  # [tokens (or a tile), intermediate] gradients an MLP's backward holds at once
BUCKET_BYTES = 25 * 2 ** 20  # dp_config bucket_size_mb's default (data_parallel/buckets.py)
BUCKET_COPIES = 2  # a bucket's flat buffer and the pieces it is split back into, beside the gradients
# a MoE layer, per token (measured on gpt-oss, stacked experts): expert-width tensors per top-k copy (its
# gate/up output, clamps, GLU), and routing bookkeeping (logits, weights, per-expert masks) per expert
MOE_TENSORS_PER_EXPERT_WIDTH = 10
MOE_ROUTER_BYTES_PER_EXPERT = 292
FUSED_KERNELS = ("rms_norm", "rope")  # GPU kernels whose activations `fused` may count
# the vision-language terms a stage reports (vision_language.vision_terms; zeros for a text model)
VISION_TERMS = ("vision_activations", "features", "merge", "inputs_embeds", "pixel_values", "batch_check",
                "exchange_bytes", "patches")


def stage_layers(model, pp, stage):
    """Decoder layers of pipeline stage `stage`: L // p, plus one on the first L % p stages (Paddle's rule)."""
    return model.layers // pp + (1 if stage < model.layers % pp else 0)


def stage_params(model, layout, stage):
    """(dense, routed-expert) parameter elements one rank of `stage` holds before sharding: split over tp
    and ep; the first stage has the embedding, the last the final norm and the lm_head (the embedding again
    when tied and split over stages)."""
    tp, pp = layout.tp, layout.pp
    layers = stage_layers(model, pp, stage)
    moe = layers * model.moe_layers / model.layers
    dense = (layers * model.attention_params + (layers - moe) * model.dense_mlp_params) / tp
    dense += layers * 2 * model.hidden + moe * model.moe_replicated_params
    if stage == 0:
        dense += model.embedding_params / tp + (model.vision.params if model.vision else 0)  # the tower: not over tp
    if stage == pp - 1:
        dense += model.hidden + (model.embedding_params / tp if pp > 1 or not model.tied_embeddings else 0)
    return dense, moe * model.expert_params / layout.ep


def gradient_elem(elem, master_grad):
    """Bytes of a gradient element: 4 for fp32 master gradients of bf16/fp16 parameters, else the parameter's."""
    return FP32 if master_grad and elem < FP32 else elem


def held_params(model, layout, stage, at_level):
    """Parameter elements of a kind of state (sharded from sharding level `at_level` on) one rank of `stage`
    holds: its owned share at that level or above, every parameter of the stage below it."""
    dense, experts = stage_params(model, layout, stage)
    if layout.sharding < at_level:
        return dense + experts
    # each parameter has one owner (largest first onto the least-loaded rank): the busiest rank holds at least
    # the largest whole parameter (measured: the 2 MiB embedding beside 1.19 MiB shares on ring4 level 3)
    owned = max(dense / layout.shard_ranks, min(dense, model.largest_param / layout.tp))
    return owned + experts / max(1, layout.shard_ranks // layout.ep)


def stepped_params(model, layout, stage):
    """Parameter elements whose optimizer state one rank of `stage` holds and steps (sharded from level 1)."""
    return held_params(model, layout, stage, 1)


def _state(model, layout, stage, elem, grad_elem):
    """weights, gradients (held after the step's reduction), optimizer state, and the whole gradients
    (`grad_elem` bytes an element)."""
    dense, experts = stage_params(model, layout, stage)
    level = layout.sharding

    def share(at_level):  # optimizer state from level 1, gradients from 2, weights from 3
        return held_params(model, layout, stage, at_level)

    optimizer_bytes = MOMENTS_BYTES + (FP32 if elem < FP32 else 0)  # below fp32: an fp32 master copy
    optimizer, host_optimizer = share(1) * optimizer_bytes, 0
    if layout.offload_optimizer:  # the same state, on the host (an fp32 parameter's copy there is transient)
        optimizer, host_optimizer = 0, optimizer
    whole = (dense + experts) * grad_elem
    bucket = min(BUCKET_BYTES, whole)
    # levels 2-3: buckets are reduce-scattered as backward fills them (not under a pipeline: in its step)
    held = whole if level < 2 or layout.pp > 1 else min(whole, share(2) * grad_elem + bucket)
    return {"weights": share(3) * elem, "gradients": share(2) * grad_elem, "optimizer": optimizer,
            "host_optimizer": host_optimizer, "whole_gradients": whole, "held_gradients": held, "bucket": bucket}


def fuses(fused, kernel):
    """Whether `fused` (True: every GPU kernel; else a collection of FUSED_KERNELS) includes `kernel`."""
    return fused is True or kernel in (fused or ())


def layer_activations(model, layout, tokens, seq, batch, elem, moe, fused=False):
    """Bytes one decoder layer (a MoE layer if `moe`) holds for one micro-batch (`tokens` per rank, `batch`
    sequences of `seq`) without recomputation, by block, and what recomputation works with:
    {"attention", "mlp", "block_input" (a block's [t, h] input), "core_attention" (attention's output and lse),
    "tile_work" (a tiled MLP's backward working set)}. `fused`: GPU kernels (fused RMSNorm, fused RoPE)."""
    tp, h, d = layout.tp, model.hidden, model.head_dim
    heads, kv_heads = model.heads // tp, model.kv_heads // tp
    norm = norm_bytes(model, layout, tokens, elem, fused)
    rope = 0 if fuses(fused, "rope") else tokens * (heads + kv_heads) * d * 2 * FP32  # q, k and their rotated halves, fp32
    block_input = tokens * h * elem
    copies = 1 if tp > 1 else 0
    attention = attention_held_bytes(layout.backend, batch, seq, heads, kv_heads, d, layout.cp, elem,
                                     layout.ulysses)
    if moe:  # experts and shared experts are not split over tp; under ep the same count, elsewhere
        routed = MOE_TENSORS_PER_EXPERT_WIDTH * model.experts_per_token * model.expert_intermediate + h
        mlp = tokens * (MOE_ROUTER_BYTES_PER_EXPERT * model.experts + (routed + 4 * model.shared_intermediate) * elem)
        mlp_backward = 0
    elif layout.mlp_tile:  # SequenceTiled keeps the MLP's input alone; its backward works on one tile at a time
        mlp = copies * block_input
        mlp_backward = tile_working_set(model, layout, tokens, elem)
    else:  # gate, up, activation, product
        mlp = tokens * 4 * model.intermediate / tp * elem + copies * block_input
        mlp_backward = tokens * MLP_GRADIENT_TENSORS * model.intermediate / tp * elem
    return {"attention": norm + 2 * copies * block_input + rope + attention, "mlp": norm + mlp,
            "block_input": block_input, "core_attention": tokens * heads * (d * elem + FP32),
            "mlp_backward": mlp_backward}


def replays_attention(layout):
    """Whether recomputation runs attention's forward again in backward (full layers, or selective with it)."""
    return layout.recompute == RECOMPUTE_FULL or bool({"core_attn", "full_attn"} & set(layout.selective))


def ring_replay_received(model, layout, seq, batch, elem):
    """Bytes of k/v the busiest ring member receives in one forward of one layer: `batch` sequences of one causal
    document in 2R chunks, its share of the k/v heads (0 without a ring)."""
    if layout.ring == 1:
        return 0
    heads = ring_kv_heads(model.heads // layout.tp, model.kv_heads // layout.tp, layout.ulysses)
    return int(received_rows(chunk_reads(seq, layout.ring)).max()) * batch * heads * 2 * model.head_dim * elem


def ring_replay_held(model, layout, seq, batch, elem):
    """Bytes of k/v a rank's replayed ring attention holds from its forward to its backward (ring.py: what it
    received, where that fits exchange.REPLAY_HOLD_LIMIT); 0 where attention is not replayed."""
    received = ring_replay_received(model, layout, seq, batch, elem) if replays_attention(layout) else 0
    return received if replay_holds(received) else 0


def norm_bytes(model, layout, tokens, elem, fused=False):
    """An RMSNorm's: its input (an fp32 copy) and normalized value at t/tp, and the output at t, which the
    projections read, or under tensor parallelism each column-split projection's own copy of it (q, k, v;
    gate, up). Fused (GPU): its input and an fp32 inverse rms per token, and the output."""
    h, tp = model.hidden, layout.tp
    return tokens / tp * rms_norm_kept(h, elem, fuses(fused, "rms_norm")) + tokens * h * elem


def tile_working_set(model, layout, tokens, elem):
    """What a SequenceTiled MLP's backward adds while it replays one tile: the tile's gate, up, activation and
    product and MLP_GRADIENT_TENSORS of their gradients, and the [t, h] input gradient it writes tile by tile."""
    tile = min(layout.mlp_tile, tokens)
    return (tile * (4 + MLP_GRADIENT_TENSORS) * model.intermediate / layout.tp + tokens * model.hidden) * elem


def recompute_inputs(model, layout, tokens, elem):
    """Bytes a fully recomputed layer's call saves: its input and the rotary tables passed to it (fp32)."""
    return tokens / layout.tp * model.hidden * elem + tokens * 2 * model.head_dim * FP32


def kept_by_layer(model, layout, parts, tokens, elem):
    """Bytes a layer keeps on the device until its backward under the layout's recomputation."""
    if layout.recompute == RECOMPUTE_FULL:  # on the host under offload
        return 0 if layout.offload else recompute_inputs(model, layout, tokens, elem)
    attention, mlp = parts["attention"], parts["mlp"]
    if "full_attn" in layout.selective:
        attention = parts["block_input"]
    elif "core_attn" in layout.selective:
        attention -= parts["core_attention"]
    if "mlp" in layout.selective:
        mlp = parts["block_input"]
    return attention + mlp


def in_flight(layout, stage):
    """Micro-batches of this stage's layers whose activations wait for their backward at once (in units of
    the stage's whole layer set): 1F1B holds p - stage, interleaved 1F1B its warm-up's chunks plus one."""
    p, v, m = layout.pp, layout.vpp, layout.micro
    if p == 1:
        return 1
    warmup = p - 1 - stage if v == 1 else 2 * (p - 1 - stage) + (v - 1) * p
    return min(m * v, warmup + 1) / v


def activations(model, layout, seq, batch, elem, stage, fused=False):
    """(held at the end of the forward, a layer's backward working set, held in host memory) for `stage`. The
    working set: the layer rebuilt by recomputation (with a tiled MLP's tile) or, without, a tiled MLP's tile;
    under offload also its own inputs brought back and the next layer's, prefetched."""
    sequences = batch / layout.micro  # per micro-batch
    tokens = sequences * seq / layout.cp
    layers = stage_layers(model, layout.pp, stage)
    moe_layers = layers * model.moe_layers / model.layers
    held, working = 0, 0
    for count, moe in ((moe_layers, True), (layers - moe_layers, False)):
        if count:
            parts = layer_activations(model, layout, tokens, seq, sequences, elem, moe, fused)
            held += count * kept_by_layer(model, layout, parts, tokens, elem)
            rebuilt = (parts["attention"] + parts["mlp"] + ring_replay_held(model, layout, seq, sequences, elem)
                       if layout.recompute != NO_RECOMPUTE else 0)
            working = max(working, rebuilt + parts["mlp_backward"])
    saved_inputs = recompute_inputs(model, layout, tokens, elem)
    host = layers * saved_inputs * in_flight(layout, stage) if layout.offload else 0
    if layout.offload:
        working += 2 * saved_inputs
    held *= in_flight(layout, stage)
    if stage == layout.pp - 1:  # the final norm
        held += norm_bytes(model, layout, tokens, elem, fused)
    return held, working, host


def logits(model, layout, seq, batch, stage):
    """(held at the end of the forward, added by the loss backward) on the last stage, one micro-batch. The
    lm_head's output is gathered over tp (no vocabulary-parallel loss): whole-vocabulary logits on every rank.
    PaddleFormers chunks only sequences longer than the chunk."""
    if stage != layout.pp - 1:
        return 0, 0
    tokens = batch / layout.micro * seq / layout.cp
    if layout.loss_chunk and layout.loss_chunk < tokens:
        return 0, (CHUNK_TEMPORARIES * layout.loss_chunk + HEAD_WEIGHT_COPIES * model.hidden) * model.vocab * FP32
    held = tokens * model.vocab * FP32
    return held, LOSS_BACKWARD_LOGITS * held


def vision_stage_terms(model, layout, seq, batch, elem, stage, fused=False, vision=None):
    """vision_language.vision_terms of the stage's micro-batch (the tower runs on the first stage), and `held`:
    what it keeps to the tower's backward (its activations and the merge's, for every micro-batch in flight, and
    the batch's pixel values), `backward`: what the tower's backward adds at its largest (the merged embeddings'
    two gradients and the features', or the features' and the recomputed block's with its MLP gradients)."""
    if vision is None or stage != 0 or not model.vision:
        return {**NO_VISION, "held": 0, "backward": 0, "batch_check": 0}
    sequences = batch / layout.micro
    terms = {k: v * (batch if k == "pixel_values" else sequences)
             for k, v in vision_terms(model, layout, seq, elem, fuses(fused, "rms_norm"), vision,
                                      layout.recompute == RECOMPUTE_FULL).items()}
    held = (terms["vision_activations"] + terms["merge"]) * in_flight(layout, stage) + terms["pixel_values"]
    mlp_gradients = terms["patches"] * MLP_GRADIENT_TENSORS * model.vision.intermediate * elem
    backward = terms["features"] + max(2 * terms["inputs_embeds"], terms["vision_rebuilt"] + mlp_gradients)
    return {**terms, "held": held, "backward": backward, "batch_check": batch_check_bytes(terms["pixel_values"])}


def stage_memory(model, layout, seq, batch, elem, stage, fused=False, master_grad=True, vision=None):
    grad_elem = gradient_elem(elem, master_grad)
    state = _state(model, layout, stage, elem, grad_elem)
    held, rebuilt, host = activations(model, layout, seq, batch, elem, stage, fused)
    tower = vision_stage_terms(model, layout, seq, batch, elem, stage, fused, vision)
    logits_held, loss_backward = logits(model, layout, seq, batch, stage)
    # a fetched copy and its gradient
    fetched = model.largest_param / layout.tp * (elem + grad_elem) if layout.sharding == 3 else 0
    base = state["weights"] + state["optimizer"]
    gradients = state["held_gradients"]
    if layout.pp > 1 and layout.micro > 1:
        # later micro-batches run while the gradients of earlier ones are held; on the last stage the
        # runner also still holds the previous micro-batch's logits (measured: one more logits tensor)
        loss_backward += gradients + logits_held
        during_layers = held + gradients
    else:
        during_layers = max(held, gradients)  # activations freed as gradients appear, layer by layer
    # the host optimizer's new fp32 value back on the device, and its cast to the parameter's dtype there
    returning = 0
    if layout.offload_optimizer:
        returning = model.largest_param / layout.tp * (FP32 + (elem if elem < FP32 else 0))
    phases = {"loss_backward": base + held + logits_held + loss_backward + tower["held"],
              "layer_backward": base + during_layers + rebuilt + fetched + tower["held"],
              "step": base + gradients + max(BUCKET_COPIES * state["bucket"], returning) + tower["pixel_values"]}
    if tower["held"]:  # the decoder's activations are gone, every gradient but the tower's is made
        phases["vision_backward"] = base + gradients + tower["held"] + tower["backward"] + fetched
        phases["batch_check"] = base + tower["pixel_values"] + tower["batch_check"]  # before the tower's forward
    return {"weights": state["weights"], "gradients": state["gradients"], "optimizer": state["optimizer"],
            "activations": held, "logits": logits_held, "phases": phases, "peak": max(phases.values()),
            "stage": stage, "host": host + state["host_optimizer"],
            **{term: tower[term] for term in VISION_TERMS}}


def memory(model, layout, seq, batch=1, elem=2, fused=False, master_grad=True, vision=None):
    """Per-rank bytes of the busier of the first and last pipeline stage (see the module docstring); `host`:
    the offloaded bytes it keeps in host memory (layer inputs and optimizer state). `elem`: bytes of a parameter
    and activation element (2: bf16/fp16 O2, PaddleFormers' default); `master_grad`: fp32 gradients below fp32.
    `fused`: GPU kernels' activations (True: fused RMSNorm and RoPE; or the FUSED_KERNELS named). `vision`: a
    vision_language.VisionBatch, each sequence's media and how the tower runs (a vision-language model's)."""
    stages = {0, layout.pp - 1}
    return max((stage_memory(model, layout, seq, batch, elem, s, fused, master_grad, vision) for s in stages),
               key=lambda m: m["peak"])


def measured_parts(estimate):
    """The estimate under pcp-memory's names (params, optimizer, activations, logits, peak, host)."""
    return {"params": estimate["weights"], "optimizer": estimate["optimizer"], "activations": estimate["activations"],
            "logits": estimate["logits"], "peak": estimate["peak"], "host": estimate["host"]}

