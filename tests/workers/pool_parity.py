"""One pool over dp x sep (PrepareContextParallel(pool=True)) trains like one card on the global batch.

dp2 x sep(N/2): every rank passes the global batch (4 rows of 61 tokens, packed documents of uneven lengths, 1 to
30 tokens); the pool joins the rows and lays them out over all N ranks as one ring. PaddleFormers' Llama (eager
attention, fp32) trains 3 AdamW steps (epsilon 1e-3), each rank's mean loss weighted by loss_weight of its
labelled tokens (-100 at each document's last token, the packed recipe),
against one card given the same 4 rows with their documents as attn_mask_startend_row_indices. Also: the labels
split by shard_sequence equal those the plan's hook splits and unshard back to the global batch; each rank's
token count; the planned exchange's bytes against what the exchange plan predicts; the layout chosen once in
a step (by shard_sequence, the forward taking it); one rank passing a different
batch (its replica's half, as a data-parallel loader gives it) refused on every rank, naming the fix; rows
without documents and with padding (a 2-D attention_mask) give one card's loss.
"""
import numpy as np
import paddle
import paddle.distributed as dist
from paddleformers_models import build as build_family
from real_model_parity import adamw
from report import mean_over_ranks, run, train

import paddle_cp as pcp
from paddle_cp.attention import Documents
from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
from paddle_cp.attention.layout.pool import joined_documents
from paddle_cp.plans import context_parallel
from paddle_cp.tools import packing

STEPS = 3
# (rows of the global batch, tokens a row, the document lengths the rows are cut from)
SHORT = (4, 509, [23, 3, 1, 140, 9, 5, 300, 2, 19, 7, 611, 4, 26, 6, 1, 8, 170, 45, 90])  # whole on 4 ranks, not on 8
WHOLE = (4, 509, [23, 3, 1, 40, 9, 5, 30, 2, 19, 7, 61, 4, 26, 6, 1, 8, 17, 45, 9])  # SFT-like: whole on 8 ranks
LONG = (2, 1021, [900, 37, 60, 5, 700, 11, 300])  # two documents longer than a rank's share: cut over ranks


def llama():
    paddle.seed(2024)
    return build_family("llama")


def batches(case):
    """Per step: ids, labels, position ids and the documents' end rows [b, 1, s, 1] (one card's mask)."""
    rows, seq, lengths = case
    positions = packing.packed_position_ids(np.array(lengths), seq, rows)
    ends = Documents.from_position_ids(positions).end
    rng = np.random.RandomState(7)
    vocab = llama().config.vocab_size
    for _ in range(STEPS):
        ids = rng.randint(0, vocab, [rows, seq + 1])
        labels = np.where(ends == np.arange(seq) + 1, -100, ids[:, 1:])  # a document's last token: no successor
        yield (paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(labels), paddle.to_tensor(positions),
               paddle.to_tensor(ends[:, None, :, None], dtype="int32"))


def reference(case):
    model = llama()
    return train(model, adamw(model), (
        model(input_ids=ids, labels=labels, position_ids=positions, attn_mask_startend_row_indices=ends)[0]
        for ids, labels, positions, ends in batches(case)))


def pooled(report, mesh, name, case):
    prepare = pcp.PrepareContextParallel("p2p", documents="position_ids", pool=True)
    plan = {"": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    model = llama()
    model, opt = pcp.parallelize(model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plan}})
    losses, grads = [], None
    chooser, chosen = context_parallel.pool_layout, []
    context_parallel.pool_layout = lambda *args, **kwargs: chosen.append(1) or chooser(*args, **kwargs)
    for step, (ids, labels, positions, _) in enumerate(batches(case)):
        local = pcp.shard_sequence(labels, backend=prepare, mesh=mesh, position_ids=positions)  # [1, my tokens]
        if step == 0:
            report.value(f"{name}.tokens", int(local.shape[1]))
            report.diff(f"{name}.unshard", pcp.unshard_sequence(local, backend=prepare, mesh=mesh, seq_len=case[1],
                                                                position_ids=positions), labels)
            pcp.reset_counters()
        weight = pcp.loss_weight(int((local != -100).sum()), mesh)  # this rank's labelled tokens
        loss = model(input_ids=ids, labels=labels, position_ids=positions)[0] * weight
        loss.backward()
        if step == 0:
            report.value(f"{name}.ring_bytes", pcp.bytes_sent().get("ring", 0))
            report.value(f"{name}.layouts_chosen", len(chosen))  # shard_sequence's layout serves the forward
        opt.step()  # averages the gradients over dp x sep first
        grads = grads or {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        opt.clear_grad()
        losses.append(loss)
    context_parallel.pool_layout = chooser
    report.training(name, (mean_over_ranks(losses, mesh), grads, {n: p.numpy() for n, p in model.named_parameters()}),
                    reference(case))
    record_plan(report, name, case, prepare, mesh, model.config)


def record_plan(report, name, case, prepare, mesh, config):
    """The layout, and the bytes its exchange plan says this rank's ring sends in one forward + backward of the
    model (k/v rows other ranks' tiles read, forward and again in backward, and the gradients of those it read)."""
    from paddle_cp.plans.context_parallel import Pool

    rows, seq, _ = case
    positions = next(batches(case))[2].numpy()
    pool = Pool(prepare, mesh)
    documents = Documents.from_position_ids(positions)
    layout = pool.batch_layout(documents, rows, seq)
    plan = ExchangePlan(layout.ring_positions(rows * seq), True, joined_documents(documents, rows, seq))
    head_dim = config.hidden_size // config.num_attention_heads
    row_bytes = config.num_key_value_heads * head_dim * 2 * 4  # one token's fp32 k and v
    sent = exchange_bytes(plan, row_bytes, row_bytes)
    report.value(f"{name}.ring_bytes_planned", int(sent.planned[pool.index]) * config.num_hidden_layers)
    report.value(f"{name}.ring_bytes_read", int(sent.read[pool.index]) * config.num_hidden_layers)
    report.value(f"{name}.rows_read", plan.counts.tolist())


def padded(report, mesh):
    """No documents (each row one causal document) and padding at the rows' starts (a 2-D attention_mask, its labels
    ignored): the pool's weighted losses sum to one card's loss on the global batch (one forward)."""
    rows, seq = 4, 77
    rng = np.random.RandomState(3)
    tokens = rng.randint(0, llama().config.vocab_size, [rows, seq + 1])
    mask = np.ones([rows, seq], np.int64)
    for row, pad in enumerate([0, 9, 30, 3]):
        mask[row, :pad] = 0  # left padding: keys every valid query would see unless masked
    ids, mask = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(mask)
    labels = paddle.to_tensor(np.where(mask.numpy() == 1, tokens[:, 1:], -100))
    want = float(llama()(input_ids=ids, labels=labels, attention_mask=mask)[0])
    prepare = pcp.PrepareContextParallel("p2p", pool=True)
    plan = {"": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    model, _ = pcp.parallelize(llama(), None, mesh, {"cp_config": {"parallelize_plan": plan}})
    local = pcp.shard_sequence(labels, backend=prepare, mesh=mesh)
    weight = pcp.loss_weight(int((local != -100).sum()), mesh)
    loss = model(input_ids=ids, labels=labels, attention_mask=mask)[0] * weight
    report.diff("padded.loss", np.array(mean_over_ranks([loss], mesh)), np.array([want]))


def refusals(report, mesh):
    """A rank passing its replica's rows instead of the global batch: every rank raises, naming the fix."""
    prepare = pcp.PrepareContextParallel("p2p", documents="position_ids", pool=True)
    plan = {"": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    model, _ = pcp.parallelize(llama(), None, mesh, {"cp_config": {"parallelize_plan": plan}})
    ids, labels, positions, _ = next(batches(SHORT))
    if dist.get_rank() == 1:
        ids, labels, positions = ids[:2], labels[:2], positions[:2]
    report.expect_error("other_batch", lambda: model(input_ids=ids, labels=labels, position_ids=positions))
    report.expect_error("all2all", lambda: pcp.PrepareContextParallel("all2all", pool=True))


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(np.arange(world).reshape(2, world // 2).tolist(), dim_names=["dp", "sep"])
    pooled(report, mesh, "short", SHORT)
    pooled(report, mesh, "long", LONG)
    pooled(report, mesh, "whole", WHOLE)
    padded(report, mesh)
    refusals(report, mesh)


run(main)
