"""PaddleFormers Llama trained with recomputation and chunked losses under cp_config vs
one card with neither.

Recompute styles: "layers" (PaddleFormers' own flags: every decoder layer re-run in
backward by fleet.utils.recompute, reentrant) and "attn.reentrant" / "attn.plain"
(the user wraps each self_attn's forward in fleet.utils.recompute, reentrant or not:
its replay runs outside the layer's hooks). Losses: PaddleFormers' own options,
"subbatch" (loss_subbatch_sequence_length: the cross entropy in chunks of the full
logits) and "fused" (with use_fused_head_and_loss_fn: lm_head and loss in chunks of
tokens, recomputed in backward, no whole-sequence logits). Each step may accumulate
two micro-batches of different lengths, both forwards before one backward.
3 AdamW steps (epsilon 1e-3). Each run's ring bytes and calls are recorded, and on one causal document
(no packing) what the planned exchange plan says a rank sends: recomputed or not, 3 x the k/v rows read.
"""
import functools

import paddle
import paddle.distributed as dist
from batches import make_batch
from llama_models import build_llama, loss_of
from paddle.distributed.fleet.utils import recompute
from report import mean_over_ranks, run, train_steps

import paddle_cp as pcp
from paddle_cp.attention import SequenceLayout
from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
from paddle_cp.comm import counters

STEPS = 3
RECOMPUTE_FLAGS = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
LOSS_FLAGS = {None: {}, "subbatch": dict(loss_subbatch_sequence_length=4),
              "fused": dict(use_fused_head_and_loss_fn=True, loss_subbatch_sequence_length=4)}


def runs(world):
    """(backend, ulysses_degree, extra tokens, packed, rotate, recompute style, accumulate, loss)."""
    table = [
        ("p2p", None, 0, None, "planned", "layers", False, None),
        ("p2p", None, 3, "position_ids", "allgather", "attn.plain", True, "fused"),
        ("p2p", None, 1, "dense", "planned", "attn.reentrant", False, None),
        ("all2all", None, 1, "startend", "planned", "layers", True, "subbatch"),
        ("all2all", None, 3, "dense", "allgather", "layers", False, "fused"),
        ("all2all", None, 1, None, "planned", "attn.reentrant", False, None),
        ("p2p", None, 1, "startend", "planned", "attn.plain", False, None),
        ("p2p", None, 1, None, "planned", None, False, "fused"),
    ]
    if world == 4:
        table += [("hybrid", 2, 2, "position_ids", "planned", "layers", True, "fused"),
                  ("hybrid", 2, 3, "dense", "allgather", "attn.plain", False, None)]
    return table


def adamw(model):
    return paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-3, parameters=model.parameters())


def recompute_attention(model, reentrant):
    """Each self_attn's forward through fleet.utils.recompute, as a user would wrap a sublayer."""
    for layer in model.model.layers:
        forward = layer.self_attn.forward

        @functools.wraps(forward)  # recompute binds arguments by this signature
        def output_only(*args, forward=forward, **kwargs):
            return forward(*args, **kwargs)[0]

        def recomputed(*args, output_only=output_only, **kwargs):
            return recompute(output_only, *args, use_reentrant=reentrant, **kwargs), None

        layer.self_attn.forward = recomputed


def build(style, loss=None):
    paddle.seed(2024)
    model = build_llama("paddleformers", **(RECOMPUTE_FLAGS if style == "layers" else {}), **LOSS_FLAGS[loss])
    if style and style.startswith("attn."):
        recompute_attention(model, style == "attn.reentrant")
    return model


def micro_batches(seq, packed, accumulate):
    return [make_batch(seq, packed)] + ([make_batch(seq - 1, packed)] if accumulate else [])


def inputs(batch, packed):
    ids, labels, positions, mask, ends = batch
    extra = {"attention_mask": mask} if packed == "dense" else {}
    if packed == "startend":
        extra = {"attn_mask_startend_row_indices": ends}
    return dict(input_ids=ids, position_ids=positions, **extra)


def train(model, opt, batches, loss_fn):
    return train_steps(model, opt, batches, loss_fn, STEPS)  # every forward before the one backward


def reference(seq, packed, accumulate):
    model = build(None)
    single_card = "dense" if packed else None  # one card sees packed documents as a dense mask
    batches = micro_batches(seq, packed, accumulate)
    losses, grads, params = train(model, adamw(model), batches, lambda m, b: loss_of(
        m(labels=b[1], **inputs(b, single_card))))
    return [float(x) for x in losses], grads, params


def parallel(seq, mesh, backend, degree, packed, rotate, style, accumulate, loss):
    model = build(style, loss)
    prepare = pcp.PrepareContextParallel(backend, degree, documents="position_ids" if packed == "position_ids" else None)
    plan = {"model": prepare, "model.layers.*.self_attn": pcp.ContextParallel(backend, degree, rotate=rotate)}
    model, opt = pcp.parallelize(model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plan}})

    def weighted_loss(m, batch):
        given = inputs(batch, packed)
        labels = pcp.shard_sequence(batch[1], backend=prepare, mesh=mesh, position_ids=given["position_ids"],
                                    attn_mask_startend_row_indices=given.get("attn_mask_startend_row_indices"))
        return loss_of(m(labels=labels, **given)) * pcp.loss_weight(labels.numel(), mesh)

    bytes_before, calls_before = counters.bytes_sent("ring"), counters.collectives_issued("ring")
    losses, grads, params = train(model, opt, micro_batches(seq, packed, accumulate), weighted_loss)
    sent = {"bytes": counters.bytes_sent("ring") - bytes_before, "calls": counters.collectives_issued("ring") - calls_before}
    return (mean_over_ranks(losses, mesh), grads, params), sent


def planned_bytes(seq, world, config):
    """Ring bytes the exchange plan says this rank sends in STEPS steps of one causal document of `seq` tokens
    over the p2p layout (batch 2, fp32 k/v and gradients): every layer's 3 x rows read."""
    plan = ExchangePlan(SequenceLayout("p2p", world).ring_positions(seq), True)
    head_dim = config.hidden_size // config.num_attention_heads
    row_bytes = 2 * config.num_key_value_heads * 2 * head_dim * 4
    return STEPS * config.num_hidden_layers * int(exchange_bytes(plan, row_bytes, row_bytes).planned[dist.get_rank()])


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    names, references = [], {}
    for backend, degree, extra, packed, rotate, style, accumulate, loss in runs(world):
        seq = 8 * world + extra
        key = (seq, bool(packed), accumulate)
        if key not in references:
            references[key] = reference(seq, packed, accumulate)
        name = f"{backend}.seq{seq}.{packed}.{rotate}.{style}.{loss}{'.accumulate' if accumulate else ''}"
        names.append(name)
        got, sent = parallel(seq, mesh, backend, degree, packed, rotate, style, accumulate, loss)
        report.training(name, got, references[key])
        if backend == "p2p" and rotate == "planned" and packed is None and not accumulate:
            sent["planned"] = planned_bytes(seq, world, build(None).config)
        report.value(f"{name}.ring", sent)
    report.value("runs", names)


run(main)
