"""Packed documents under the documents layout (PrepareContextParallel's split when it knows them): PaddleFormers'
Llama as users build it (eager attention) trains 3 AdamW steps like one card on the same batches, which the one
card sees through PaddleFormers' own attn_mask_startend_row_indices.

The batch: 2 rows of 61 tokens (not a multiple of 2N), different documents per row, from 1 to 30 tokens (shorter
than 2N included). Runs at N = 4: p2p, all2all and hybrid (U = 2) with documents="position_ids"; p2p given only the
row indices; p2p with PaddleFormers' full recompute; two pipeline stages of two ring ranks with two micro-batches
(each micro-batch attends with its own rows' documents). Labels are split with shard_sequence given the batch's
document inputs, except under the pipeline, whose plan on the root splits them. Also: the errors of a label split
that cannot follow the inputs', raised on every rank; check_parity on documents="position_ids" plans (Llama and
Gemma3: the one-card forward given the same documents as row indices) and a doc_ids plan (fp32, then bf16 O2
under the emulated AMP); ContextParallel without
PrepareContextParallel: the same full batch on every rank refused (on dp2 x sep2 on every rank when one replica
passes it), inputs the script shards itself trained like one card.
"""
import functools

import numpy as np
import paddle
import paddle.distributed as dist
from amp_emulation import emulated
from paddleformers_models import build as build_family
from real_model_parity import adamw
from report import run, train

import paddle_cp as pcp
from paddle_cp import mesh as mesh_lib
from paddle_cp.attention import Documents
from paddle_cp.comm import collectives
from paddle_cp.tools import packing

STEPS, SEQ, BATCH, VOCAB = 3, 61, 2, 64
LENGTHS = [23, 3, 1, 14, 9, 5, 30, 2, 19, 7, 11, 4, 26, 6, 1, 8]  # the stream both rows are cut from


def llama(**config):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(2024)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False, **config))


def batches():
    """Per step: ids, labels, position ids and the documents' end rows [b, 1, s, 1] (one card's mask)."""
    positions = packing.packed_position_ids(np.array(LENGTHS), SEQ, BATCH)
    ends = Documents.from_position_ids(positions).end  # [b, s]: a document ends where the next one starts
    rng = np.random.RandomState(5)
    for _ in range(STEPS):
        ids = rng.randint(0, VOCAB, [BATCH, SEQ + 1])
        yield (paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:]), paddle.to_tensor(positions),
               paddle.to_tensor(ends[:, None, :, None], dtype="int32"))


@functools.lru_cache(maxsize=None)  # five runs share the plain model's: trained once (results only read)
def reference(**config):
    model = llama(**config)
    losses, grads, params = train(model, adamw(model), (
        model(input_ids=ids, labels=labels, position_ids=positions, attn_mask_startend_row_indices=ends)[0]
        for ids, labels, positions, ends in batches()))
    return [float(x) for x in losses], grads, params


def sep_mean(values, mesh):
    """The global loss from each sep rank's weighted share of it."""
    group = mesh_lib.mesh_group(mesh, ["sep"])
    return (collectives.all_reduce(group, paddle.to_tensor(values, dtype="float32")) / group.size).numpy().tolist()


def held(model, values):
    """Only what this rank keeps (a pipeline stage frees the other stages' parameters)."""
    return {n: v for n, v in values.items() if dict(model.named_parameters())[n]._is_initialized()}


def trained(model, opt, step_loss):
    losses, grads, params = train(model, opt, (step_loss(model, *batch) for batch in batches()))
    return [float(x) for x in losses], grads, held(model, params)


def sequence_parallel(report, mesh, name, backend, degree=None, rows_only=False, **config):
    """The plan on `model` (Paddle's docs' style), labels split by hand with the batch's document inputs."""
    prepare = pcp.PrepareContextParallel(backend, degree, documents=None if rows_only else "position_ids")
    plan = {"model": prepare, "model.layers.*.self_attn": pcp.ContextParallel(backend, degree)}
    model = llama(**config)
    model, opt = pcp.parallelize(model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plan}})

    def step_loss(m, ids, labels, positions, ends):
        documents = dict(attn_mask_startend_row_indices=ends) if rows_only else dict(position_ids=positions)
        local = pcp.shard_sequence(labels, backend=prepare, mesh=mesh, **documents)
        out = m(input_ids=ids, labels=local, position_ids=positions,
                **(dict(attn_mask_startend_row_indices=ends) if rows_only else {}))
        return out[0] * pcp.loss_weight(local.numel(), mesh)

    losses, grads, params = trained(model, opt, step_loss)
    report.training(name, (sep_mean(losses, mesh), grads, params), reference(**config))
    record_layout(report, name, prepare, mesh)


def record_layout(report, name, prepare, mesh):
    """Whether this rank's positions differ from the 2N chunks', and both layouts' work imbalance."""
    positions = next(batches())[2]
    mine = pcp.sequence_positions(SEQ, backend=prepare, mesh=mesh, position_ids=positions,
                                  attn_mask_startend_row_indices=None if prepare.documents else next(batches())[3])
    chunks = pcp.sequence_positions(SEQ, backend=prepare.backend, mesh=mesh, ulysses_degree=prepare.ulysses_degree)
    report.value(f"{name}.moved", not np.array_equal(mine.numpy(), chunks.numpy()))
    per_position = (positions.numpy() + 1).sum(axis=0)
    report.value(f"{name}.work", [float(per_position[mine.numpy()].sum()), float(per_position[chunks.numpy()].sum())])


def pipeline(report):
    """pp2 x sep2: the plan on the root splits inputs and labels; two micro-batches of one row each."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "sep"])
    prepare = pcp.PrepareContextParallel("p2p", documents="position_ids")
    ids, labels, positions, _ = next(batches())
    weight = pcp.loss_weight(pcp.shard_sequence(labels, backend=prepare, mesh=mesh, position_ids=positions).numel(),
                             mesh)

    def weighted_loss(output, local_labels):  # each micro-batch's mean over this rank's tokens, weighted
        logits = output[0] if isinstance(output, (tuple, list)) else output
        loss = paddle.nn.functional.cross_entropy(logits.reshape([-1, VOCAB]), local_labels.reshape([-1, 1])).mean()
        return loss * weight

    config = {"cp_config": {"parallelize_plan": {"": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}},
              "pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 2,
                            "loss_fn": weighted_loss}}
    model = llama()
    model, opt = pcp.parallelize(model, adamw(model), mesh, config)
    losses, grads, params = trained(model, opt, lambda m, ids, labels, positions, ends: m(
        input_ids=ids, labels=labels, position_ids=positions)[0])
    want_losses, want_grads, want_params = reference()
    report.training("pp2_sep2.p2p", (sep_mean(losses, mesh), held(model, grads), params),
                    (want_losses, held(model, want_grads), held(model, want_params)))


def errors(report, mesh):
    """A label split that cannot follow the inputs' raises, on every rank alike."""
    ids, labels, positions, ends = next(batches())
    documents_plan = pcp.PrepareContextParallel("p2p", documents="position_ids")
    report.expect_error("no_position_ids", lambda: pcp.shard_sequence(labels, backend=documents_plan, mesh=mesh))
    report.expect_error("ids_plan_no_doc_ids", lambda: pcp.shard_sequence(
        labels, backend=pcp.PrepareContextParallel("p2p", documents="doc_ids"), mesh=mesh, position_ids=positions))
    report.expect_error("string_backend", lambda: pcp.shard_sequence(labels, backend="p2p", mesh=mesh,
                                                                     position_ids=positions))
    report.expect_error("unknown_layout", lambda: pcp.PrepareContextParallel("p2p", layout="even"))
    # labels split by a backend name (2N chunks) for a batch the plan splits by its documents
    prepare = pcp.PrepareContextParallel("p2p", documents="position_ids")
    plan = {"model": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    model, _ = pcp.parallelize(llama(), None, mesh, {"cp_config": {"parallelize_plan": plan}})
    pcp.shard_sequence(labels, backend="p2p", mesh=mesh)
    report.expect_error("labels_by_name", lambda: model(input_ids=ids, position_ids=positions))
    # row indices the plan was not told of: labels split without them, before and after a forward with them
    for order in ("labels_first", "forward_first"):
        prepare = pcp.PrepareContextParallel("p2p")
        plan = {"model": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
        model, _ = pcp.parallelize(llama(), None, mesh, {"cp_config": {"parallelize_plan": plan}})

        def forward(m=model):
            m(input_ids=ids, position_ids=positions, attn_mask_startend_row_indices=ends)

        def split(p=prepare):
            pcp.shard_sequence(labels, backend=p, mesh=mesh)

        if order == "labels_first":
            split()
            report.expect_error(f"rows.{order}", forward)
        else:
            forward()
            report.expect_error(f"rows.{order}", split)
        report.value(f"rows.{order}.ok_with_rows", pcp.shard_sequence(
            labels, backend=prepare, mesh=mesh, attn_mask_startend_row_indices=ends).shape)


def parity_of_documents_plans(report, mesh):
    """check_parity on a documents plan: every output against one card given the same documents (row indices it
    builds from the position ids); Gemma3's one-card mask code reads them as [b, 1, s, 1]."""
    ids, labels, positions, _ = next(batches())
    for family in ("llama", "gemma3"):
        paddle.seed(2024)
        model = build_family(family)
        plan = {"": pcp.PrepareContextParallel("p2p", documents="position_ids"),
                "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
        pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan}})
        report.value(f"check_parity.{family}", dict(pcp.check_parity(model, input_ids=ids, labels=labels,
                                                                     position_ids=positions)))
    report.expect_error("check_parity.no_position_ids", lambda: pcp.check_parity(model, input_ids=ids, labels=labels))
    # documents from an input only the plan reads: the one-card forward gets them as row indices instead
    paddle.seed(2024)
    model = build_family("llama")
    plan = {"": pcp.PrepareContextParallel("p2p", documents="doc_ids"),
            "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan}})
    doc_ids = paddle.to_tensor(np.cumsum(positions.numpy() == 0, axis=1))  # [b, s]: a new id where positions restart
    report.value("check_parity.llama.doc_ids", dict(pcp.check_parity(model, input_ids=ids, labels=labels,
                                                                     doc_ids=doc_ids)))
    # the same model in bf16 O2 under the emulated AMP: its fp32 run on one card gets the one-card inputs too
    with emulated(True):
        paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            report.value("check_parity.llama.doc_ids.bf16",
                         pcp.check_parity(model, input_ids=ids, labels=labels, doc_ids=doc_ids).as_dict())


def script_sharded(report, mesh):
    """ContextParallel alone (no PrepareContextParallel): the same whole batch on every rank is refused at the first
    forward; the script's own shards (shard_sequence, global position ids, uneven: 61 tokens over 8 chunks), their
    losses weighted by their token counts, train like one card."""
    rng = np.random.RandomState(9)
    steps = [rng.randint(0, VOCAB, [BATCH, SEQ + 1]) for _ in range(STEPS)]
    model = llama()
    want = train(model, adamw(model), (model(input_ids=paddle.to_tensor(tokens[:, :-1]),
                                             labels=paddle.to_tensor(tokens[:, 1:]))[0] for tokens in steps))
    model = llama()
    plan = {"model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    model, opt = pcp.parallelize(model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plan}})
    whole = paddle.to_tensor(steps[0])
    report.expect_error("forgotten_top_layer", lambda: model(input_ids=whole[:, :-1], labels=whole[:, 1:]))
    positions = pcp.sequence_positions(SEQ, backend="p2p", mesh=mesh).unsqueeze(0).expand([BATCH, -1])

    def step_loss(tokens):
        ids, labels = (pcp.shard_sequence(paddle.to_tensor(x), backend="p2p", mesh=mesh)
                       for x in (tokens[:, :-1], tokens[:, 1:]))
        return model(input_ids=ids, labels=labels, position_ids=positions)[0] * pcp.loss_weight(labels.numel(), mesh)

    losses, grads, params = train(model, opt, (step_loss(tokens) for tokens in steps))
    report.training("script_sharded", (sep_mean([float(x) for x in losses], mesh), grads, params), want)
    # dp2 x sep2, only the first replica passing the same whole batch: the second, given shards, stops too
    replicas = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "sep"])
    model, _ = pcp.parallelize(llama(), None, replicas, {"cp_config": {"parallelize_plan": plan}})
    tokens = whole if dist.get_rank() < 2 else pcp.shard_sequence(whole, backend="p2p", mesh=replicas)
    report.expect_error("forgotten_top_layer.one_replica",
                        lambda: model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]))


def main(report):
    mesh = dist.ProcessMesh(list(range(4)), dim_names=["sep"])
    sequence_parallel(report, mesh, "p2p", "p2p")
    sequence_parallel(report, mesh, "all2all", "all2all")
    sequence_parallel(report, mesh, "hybrid", "hybrid", 2)
    sequence_parallel(report, mesh, "p2p.rows", "p2p", rows_only=True)
    sequence_parallel(report, mesh, "p2p.recompute", "p2p", recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    pipeline(report)
    errors(report, mesh)
    parity_of_documents_plans(report, mesh)
    script_sharded(report, mesh)  # last: its tensors split by a backend name would meet the documents plans above


run(main)
