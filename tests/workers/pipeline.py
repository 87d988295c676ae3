"""Pipeline parallel vs one card: each run builds the model from one seed, trains three AdamW
steps (epsilon 1e-3, ClipGradByGlobalNorm) on a global batch and compares the loss of
every step (on every rank) and the final full_state_dict with one process doing the same.
argv[1] names the group of runs (one launch each).
"""
import contextlib
import gc
import json
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
from doc_llama import LlamaForCausalLM, cross_entropy
from doc_llama import VOCAB as DOC_VOCAB
from report import run

import paddle_cp as pcp
from paddle_cp import mesh as mesh_lib
from paddle_cp import runtime
from paddle_cp.comm import collectives

BATCH, SEQ, STEPS, CLIP, EPSILON = 4, 8, 3, 0.5, 1e-3


def doc_model():
    return LlamaForCausalLM(num_layers=3)


def llama(tie=True, **extra):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM as PFLlama
    return PFLlama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                               fuse_rms_norm=False, **extra))  # no fused CPU kernel; attention: the default (eager)


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@contextlib.contextmanager
def llama_recompute(report, name, reentrant):
    """PaddleFormers' full recompute of every decoder layer; its Llama always asks for reentrant recompute,
    so the non-reentrant run rebinds the module's `recompute` as a script patching it would. Reports how
    many calls this rank made inside a pipeline stage's forward."""
    from paddleformers.transformers.llama import modeling
    original, calls = modeling.recompute, []

    def counted(*args, **kwargs):
        calls.append(runtime.state.pipeline_running is not None)
        return original(*args, **kwargs, **({} if reentrant else {"use_reentrant": False}))

    modeling.recompute = counted
    try:
        yield lambda: llama(**FULL_RECOMPUTE)
    finally:
        modeling.recompute = original
        report.value(f"{name}.recompute_calls", sum(calls))


def build(make):
    paddle.seed(2024)
    model = make()
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, weight_decay=0.1, epsilon=EPSILON,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP),
                                       parameters=model.parameters())
    return model, optimizer


def batches(vocab, seq=SEQ):
    rng = np.random.RandomState(7)
    for _ in range(STEPS):
        yield (paddle.to_tensor(rng.randint(0, vocab, [BATCH, seq]), dtype="int64"),
               paddle.to_tensor(rng.randint(0, vocab, [BATCH, seq]), dtype="int64"))


def train(model, optimizer, vocab, step_loss, data_parallel=False, seq=SEQ):
    losses = []
    for ids, labels in batches(vocab, seq):
        if data_parallel:
            ids, labels = pcp.shard_batch((ids, labels))
        loss = step_loss(model, ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return np.array(losses)


def user_loop(model, ids, labels):
    """The plain loop: the model returns logits, the script computes the loss."""
    return cross_entropy(model(ids), labels)


def model_loss(model, ids, labels):
    """The model (or pp_config's loss_fn) computes the loss: `model(..., labels=...)[0]`."""
    return model(ids, labels=labels)[0]


def reference(make, vocab, step_loss, seq=SEQ):
    model, optimizer = build(make)
    losses = train(model, optimizer, vocab, step_loss, seq=seq)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}


def last_stage(mesh):
    return mesh.get_mesh_with_dim("pp")[-1].process_ids.count(dist.get_rank()) > 0


def held_parameters(model):
    """Names of the parameters this rank keeps (the others are freed)."""
    return sorted(n for n, p in model.named_parameters() if p._is_initialized())


def replica_mean(values, mesh):
    """The global loss from each rank's mean over its own samples and tokens (equal counts)."""
    group = mesh_lib.mesh_group(mesh, ["dp", "sep"])
    total = collectives.all_reduce(group, paddle.to_tensor(values, dtype="float32"))
    return total.numpy() / group.size


def compare(report, name, make, vocab, mesh, config, step_loss, ref_loss=None, seq=SEQ):
    """Losses on the last stage (every stage when the model computes the loss), the state on every rank,
    and (without tensor parallel) the parameters each rank holds itself, tied copies included."""
    want_losses, want_state = reference(make, vocab, ref_loss or step_loss, seq)
    model, optimizer = build(make)
    model, optimizer = pcp.parallelize(model, optimizer, mesh, config)
    report.value(f"{name}.held", held_parameters(model))
    losses = train(model, optimizer, vocab, step_loss, data_parallel="dp" in mesh.dim_names, seq=seq)
    losses = replica_mean(losses, mesh)
    if step_loss is model_loss or last_stage(mesh):
        report.diff(f"{name}.loss", losses, want_losses)
    if "mp" not in mesh.dim_names:
        for key, p in model.state_dict().items():
            if p._is_initialized():
                report.diff(f"{name}.local.{key}", p, want_state[key])
    state = pcp.full_state_dict(model)
    report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.state.{key}", state[key], value)


def pp_mesh(shape, names):
    return dist.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), dim_names=names)


def doc_pp2(report):
    mesh = pp_mesh([2], ["pp"])
    compare(report, "doc_pp2", doc_model, DOC_VOCAB, mesh, {"pp_config": {"split_spec": "llama.layers"}}, user_loop)
    for schedule, m in (("FThenB", 2), ("1F1B", 4)):
        compare(report, f"doc_pp2_{schedule}_m{m}", doc_model, DOC_VOCAB, mesh,
                {"pp_config": {"split_spec": "llama.layers", "schedule_mode": schedule, "accumulate_steps": m,
                               "loss_fn": cross_entropy}}, model_loss, ref_loss=user_loop)


def cast_after_parallelize(report, name, model):
    """What `paddle.amp.decorate(level="O2", dtype="bfloat16")` does to the model after parallelize: Paddle's
    amp_initialize (decorate calls it on a GPU; on CPU it returns before). Reports every parameter's
    [dtype, shape, holds data] before and after: the ones another rank holds must take the dtype too."""
    from paddle.amp.auto_cast import amp_initialize

    def described():
        return {n: [str(p.dtype), list(p.shape), p._is_initialized()] for n, p in model.named_parameters()}

    report.value(f"{name}.before_cast", described())
    amp_initialize(models=[model], dtype="bfloat16", excluded_layers=None)
    report.value(f"{name}.after_cast", described())


def doc_pp2_cast(report):
    """decorate O2 after parallelize on 2 stages, and before it (the cast model parallelized: its stages keep
    bf16 parameters)."""
    mesh, config = pp_mesh([2], ["pp"]), {"pp_config": {"split_spec": "llama.layers"}}
    model, optimizer = build(doc_model)
    model, _ = pcp.parallelize(model, optimizer, mesh, config)
    cast_after_parallelize(report, "doc_pp2_cast_after", model)
    from paddle.amp.auto_cast import amp_initialize
    model, optimizer = build(doc_model)
    amp_initialize(models=[model], dtype="bfloat16", excluded_layers=None)
    model, _ = pcp.parallelize(model, optimizer, mesh, config)
    report.value("doc_pp2_cast_before", {n: [str(p.dtype), p._is_initialized()] for n, p in model.named_parameters()})


def doc_pp2_scaled(report):
    """A GradScaler (scale 1024, through pcp.shard_scaler) on FThenB, 1F1B and VPP: each micro-batch's backward
    starts from its scaled loss, so every activation gradient a stage sends back is 1024 times the unscaled
    run's; unscaled before the step, the losses and parameters equal the unscaled run's."""
    from unittest import mock

    from optimizer_amp import cpu_scaler

    from paddle_cp.comm import stage_p2p
    mesh = pp_mesh([2], ["pp"])
    for schedule, extra in {"FThenB": {}, "1F1B": {}, "VPP": {"vpp_degree": 2}}.items():
        config = {"pp_config": {"split_spec": "llama.layers", "schedule_mode": schedule, "accumulate_steps": 2,
                                "loss_fn": cross_entropy, **extra}}
        runs = {}
        for scaled in (False, True):
            model, optimizer = build(lambda: LlamaForCausalLM(num_layers=4))
            model, optimizer = pcp.parallelize(model, optimizer, mesh, config)
            scaler = pcp.shard_scaler(cpu_scaler()) if scaled else None
            sent, send = [], stage_p2p.send_tensors

            def spy(pair, tensors, **kwargs):
                sent.extend(t.numpy().copy() for t in tensors)
                return send(pair, tensors, **kwargs)

            losses = []
            with mock.patch.object(stage_p2p, "send_tensors", spy):
                for ids, labels in batches(DOC_VOCAB):
                    with paddle.amp.auto_cast(scaled, level="O1", dtype="float16"):  # no-op on CPU; the scaler asks
                        loss = model_loss(model, ids, labels)
                    (scaler.scale(loss) if scaled else loss).backward()
                    if scaled:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    optimizer.clear_grad()
                    losses.append(float(loss))
            runs[scaled] = losses, sent, pcp.full_state_dict(model)
            del scaler
            gc.collect()  # the scaler (a cycle through its wrapped _unscale) is gone: the next run has none
        name = f"doc_pp2_scaled_{schedule}"
        (losses, sent, state), (want_losses, want_sent, want_state) = runs[True], runs[False]
        report.value(f"{name}.sends", [len(sent), len(want_sent)])
        if sent:  # the stages that send gradients back (all but the first; with VPP, every rank)
            sent, want_sent = (np.concatenate([g.ravel() for g in x]) for x in (sent, want_sent))
            report.diff(f"{name}.sent_gradients", sent, 1024 * want_sent)
            report.value(f"{name}.sent_gradient_size", [float(np.abs(sent).max()), float(np.abs(want_sent).max())])
        report.diff(f"{name}.loss", np.array(losses), np.array(want_losses))
        for key, value in want_state.items():
            report.diff(f"{name}.state.{key}", state[key], value)


def as_fp32(array):
    """A state array as float32 (Paddle's numpy() of a bf16 tensor gives its bits as uint16)."""
    return (array.astype(np.uint32) << 16).view(np.float32) if array.dtype == np.uint16 else array.astype(np.float32)


def doc_pp2_scaled_inf(report):
    """An inf in the last stage's gradients (rank 1 only) under pcp.shard_scaler on 1F1B: the found-inf flag
    is agreed over the mesh, both stages skip the step (their parameters unchanged)."""
    from optimizer_amp import cpu_scaler
    model, optimizer = build(lambda: LlamaForCausalLM(num_layers=4))
    config = {"pp_config": {"split_spec": "llama.layers", "schedule_mode": "1F1B", "accumulate_steps": 2,
                            "loss_fn": cross_entropy}}
    model, optimizer = pcp.parallelize(model, optimizer, pp_mesh([2], ["pp"]), config)
    scaler = pcp.shard_scaler(cpu_scaler())
    ids, labels = next(batches(DOC_VOCAB))
    with paddle.amp.auto_cast(True, level="O1", dtype="float16"):
        loss = model_loss(model, ids, labels)
    scaler.scale(loss).backward()
    if dist.get_rank() == 1:
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        paddle.assign(grad * float("inf"), grad)
    before = {k: v.numpy().copy() for k, v in model.state_dict().items() if v._is_initialized()}
    scaler.step(optimizer)
    scaler.update()
    optimizer.clear_grad()
    after = {k: v.numpy() for k, v in model.state_dict().items() if v._is_initialized()}
    report.value("doc_pp2_scaled_inf", [len(before), all(np.array_equal(before[k], after[k]) for k in before),
                                        float(scaler._scale.numpy().reshape(-1)[0])])
    del scaler
    gc.collect()


def doc_pp2_master_grad_hooks(report):
    """Paddle's master-gradient hook (what decorate(master_grad=True) arms on entering auto_cast: it casts the
    gradients to fp32 at the end of one backward) on a 1F1B step of 2 micro-batches under the script's one
    auto_cast: armed before, and fired after, every backward the schedule runs. Real Paddle (no emulation;
    fp32 parameters: the cast finds nothing to do)."""
    from unittest import mock

    from paddle.amp.auto_cast import amp_global_state
    from paddle.base import core
    model, optimizer = build(lambda: LlamaForCausalLM(num_layers=4))
    config = {"pp_config": {"split_spec": "llama.layers", "schedule_mode": "1F1B", "accumulate_steps": 2,
                            "loss_fn": cross_entropy}}
    model, optimizer = pcp.parallelize(model, optimizer, pp_mesh([2], ["pp"]), config)
    state, armed, fired = amp_global_state(), [], []
    add_hook = core.eager._add_backward_final_hook

    def counted(hook):  # Paddle's master-gradient hook (paddle_cp's buckets add final hooks of their own)
        if getattr(hook, "__name__", "") != "master_grad_hook":
            return add_hook(hook)
        armed.append(1)
        return add_hook(lambda: (fired.append(1), hook())[1])

    state.use_master_grad, state.model_parameters = True, [p for p in model.parameters() if p._is_initialized()]
    try:
        with mock.patch.object(core.eager, "_add_backward_final_hook", counted):
            ids, labels = next(batches(DOC_VOCAB))
            with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):  # on CPU it computes nothing differently
                loss = model_loss(model, ids, labels)
            loss.backward()
    finally:
        state.use_master_grad, state.model_parameters = False, []
        state.already_register_final_backward_hook = False
    optimizer.clear_grad()
    backwards = sum(1 for kind, *_ in model._pcp_pipeline.timeline if kind == "B")
    report.value("doc_pp2_master_grad_hooks", [backwards, len(armed), len(fired)])


def doc_pp2_bf16(report):
    """bf16 O2 under the emulated AMP (tests/workers/emulated_amp.py; installed for the rest of the process: run
    last): FThenB, 1F1B and VPP with decorate after parallelize, and 1F1B with it before, each against one card
    in the same emulation; one card in fp32 gives every run's distance from fp32. Reported per run: its losses
    and final parameters (fp32 values) beside the fp32 run's, and one card's bf16 run's beside it."""
    import emulated_amp

    emulated_amp.install()
    make = lambda: LlamaForCausalLM(num_layers=4)  # noqa: E731

    def trained(config=None, amp=True, decorate_first=False, master_grad=False, name=""):
        model, optimizer = build(make)
        optimizer._grad_clip = None  # the emulation's in-place multiply_ (the clip's) refuses gradients
        o2 = dict(level="O2", dtype="bfloat16", master_grad=master_grad)
        if amp and (decorate_first or config is None):
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, **o2)
        if config is not None:
            model, optimizer = pcp.parallelize(model, optimizer, pp_mesh([2], ["pp"]), config)
            if amp and not decorate_first:
                model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, **o2)
        losses, grad_dtypes = [], set()
        for ids, labels in batches(DOC_VOCAB):
            with paddle.amp.auto_cast(amp, level="O2", dtype="bfloat16"):
                loss = model(ids, labels=labels)[0] if config is not None else user_loop(model, ids, labels)
            loss.backward()
            grad_dtypes |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        state = pcp.full_state_dict(model) if config is not None else {k: v.numpy() for k, v in
                                                                       model.state_dict().items()}
        emulated_amp.reset()
        if amp:
            report.value(f"bf16_pp2_{name}.grad_dtypes" if config else "bf16_one_card.grad_dtypes", sorted(grad_dtypes))
        return np.array(losses), {k: as_fp32(v) for k, v in state.items()}

    fp32_losses, fp32_state = trained(amp=False, name="fp32")
    one_losses, one_state = trained()
    report.diff("bf16_one_card.loss", one_losses, fp32_losses)
    for key, value in fp32_state.items():
        report.diff(f"bf16_one_card.param.{key}", one_state[key], value)
    runs = {"FThenB": ("FThenB", {}, False), "1F1B": ("1F1B", {}, False), "VPP": ("VPP", {"vpp_degree": 2}, False),
            "1F1B_decorated_first": ("1F1B", {}, True), "1F1B_master_grad": ("1F1B", {}, False)}
    for name, (schedule, extra, first) in runs.items():
        config = {"pp_config": {"split_spec": "llama.layers", "schedule_mode": schedule, "accumulate_steps": 2,
                                "loss_fn": cross_entropy, **extra}}
        losses, state = trained(config, decorate_first=first, master_grad=name.endswith("master_grad"), name=name)
        report.diff(f"bf16_pp2_{name}.loss", losses, fp32_losses)
        report.diff(f"bf16_pp2_{name}.from_one_card", losses, one_losses)
        for key, value in fp32_state.items():
            report.diff(f"bf16_pp2_{name}.param.{key}", state[key], value)


def llama_pp2(report):
    """PaddleFormers Llama (4 layers, tied embeddings by default) on 2 stages, m = 4."""
    mesh = pp_mesh([2], ["pp"])
    base = {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 4}
    runs = {"llama_1f1b": ({**base, "schedule_mode": "1F1B"}, llama),
            "llama_vpp": ({**base, "schedule_mode": "VPP", "vpp_degree": 2}, llama),
            "llama_untied_fthenb": ({**base, "schedule_mode": "FThenB"}, lambda: llama(tie=False))}
    for name, (pp_config, make) in runs.items():
        compare(report, name, make, 64, mesh, {"pp_config": pp_config}, model_loss)
    with llama_recompute(report, "llama_recompute", reentrant=True) as make:
        compare(report, "llama_recompute", make, 64, mesh, {"pp_config": {**base, "accumulate_steps": 2}}, model_loss)


def llama_cp(report):
    """pp2 x sep2: ring attention inside each stage; activations cross stages in the CP layout."""
    mesh = pp_mesh([2, 2], ["pp", "sep"])
    cp = {"cp_config": {"parallelize_plan": {"": pcp.PrepareContextParallel("p2p"),
                                             "model.layers.*.self_attn": pcp.ContextParallel("p2p")}}}
    base = {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 4}
    for name, pp_config in {"llama_cp_1f1b": {**base, "schedule_mode": "1F1B"},
                            "llama_cp_vpp": {**base, "schedule_mode": "VPP", "vpp_degree": 2}}.items():
        compare(report, name, llama, 64, mesh, {**cp, "pp_config": pp_config}, model_loss)
    for name, reentrant, pp_config in (("llama_cp_recompute", True, {**base, "accumulate_steps": 2}),
                                       ("llama_cp_recompute_vpp_plain", False,
                                        {**base, "schedule_mode": "VPP", "vpp_degree": 2, "accumulate_steps": 2})):
        with llama_recompute(report, name, reentrant) as make:
            compare(report, name, make, 64, mesh, {**cp, "pp_config": pp_config}, model_loss)


def llama_cp_uneven(report):
    """pp2 x sep2 on 9 tokens (5 + 4 per sep rank): each micro-batch loss weighted by pcp.loss_weight
    inside pp_config's loss_fn, so the averaged gradient is the global token mean's."""
    mesh = pp_mesh([2, 2], ["pp", "sep"])
    prepare = pcp.PrepareContextParallel("p2p")
    local = int(pcp.shard_sequence(paddle.zeros([BATCH, 9]), backend=prepare, mesh=mesh).numel())
    weight = pcp.loss_weight(local, mesh)

    def weighted_loss(output, labels):
        return llama_loss(output, labels) * weight

    config = {"cp_config": {"parallelize_plan": {"": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}},
              "pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 2,
                            "loss_fn": weighted_loss}}
    compare(report, "llama_cp_uneven", llama, 64, mesh, config, model_loss, seq=9)


def llama_cp_returned_loss_weight(report):
    """pp2 x sep2 on 19 tokens (10 + 9): the loss model(...) returned, scaled by each rank's loss_weight.
    The schedule's backward already ran, and ring attention mixed the sep ranks' gradients: refused with a
    ValueError on every rank at the step (checked against the unweighted one-card run, so the launch
    shows the error if the refusal is gone)."""
    mesh = pp_mesh([2, 2], ["pp", "sep"])
    prepare = pcp.PrepareContextParallel("p2p")
    local = int(pcp.shard_sequence(paddle.zeros([BATCH, 19]), backend=prepare, mesh=mesh).numel())
    weight = pcp.loss_weight(local, mesh)
    config = {"cp_config": {"parallelize_plan": {"": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}},
              "pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 2}}
    report.value("returned_weight.weight", weight)
    report.expect_error("returned_weight", lambda: compare(
        report, "returned_weight", llama, 64, mesh, config,
        lambda model, ids, labels: model(ids, labels=labels)[0] * weight, ref_loss=model_loss, seq=19))


def llama_loss(output, labels):
    """PaddleFormers' own criterion on the logits (what the model computes when given labels)."""
    import paddle.nn.functional as F
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1, 1])).mean()


def doc_tensor_plan(sequence_parallel):
    """The seed's mp plan (its `llama.position_embedding` key names no layer of the doc model: left out)."""
    plan = {"llama.embed_tokens": pcp.ColWiseParallel(),
            "llama.layers.*.self_attn.qkv_proj": pcp.ColWiseParallel(),
            "llama.layers.*.self_attn.o_proj": pcp.RowWiseParallel(),
            "llama.layers.*.mlp.gate_up_proj": pcp.ColWiseParallel(),
            "llama.layers.*.mlp.down_proj": pcp.RowWiseParallel(),
            "lm_head.weight": pcp.ColWiseParallel()}
    if sequence_parallel:
        plan.update({"llama.embed_tokens": [pcp.ColWiseParallel(), pcp.SequenceParallelBegin()],
                     "llama.layers.*.self_attn": pcp.SequenceParallelDisable(),
                     "llama.layers.*.mlp": pcp.SequenceParallelDisable(need_transpose=False),
                     "lm_head": pcp.SequenceParallelEnd()})
    return {"parallelize_plan": plan}


def doc_pp4(report):
    """Four stages of the doc model (8 layers): 1F1B with m = p, and VPP (2 chunks) with m = 2 < p."""
    mesh = pp_mesh([4], ["pp"])
    for name, extra in {"doc_pp4_1f1b_m4": {"accumulate_steps": 4},
                        "doc_pp4_vpp_m2": {"schedule_mode": "VPP", "vpp_degree": 2, "accumulate_steps": 2}}.items():
        compare(report, name, lambda: LlamaForCausalLM(num_layers=8), DOC_VOCAB, mesh,
                {"pp_config": {"split_spec": "llama.layers", "loss_fn": cross_entropy, **extra}},
                model_loss, ref_loss=user_loop)


def doc_mp2_pp2(report):
    mesh = pp_mesh([2, 2], ["mp", "pp"])
    compare(report, "doc_mp2_pp2", doc_model, DOC_VOCAB, mesh,
            {"mp_config": doc_tensor_plan(False), "pp_config": {"split_spec": "llama.layers"}}, user_loop)
    compare(report, "doc_mp2_pp2_sp_1f1b", doc_model, DOC_VOCAB, mesh,
            {"mp_config": doc_tensor_plan(True), "pp_config": {
                "split_spec": "llama.layers", "accumulate_steps": 2, "loss_fn": cross_entropy}},
            model_loss, ref_loss=user_loop)


def doc_dp2_mp2_pp2(report):
    """The seed's whole config: dp2 x mp2 x pp2, sharding level 1, sequence parallel."""
    mesh = pp_mesh([2, 2, 2], ["dp", "mp", "pp"])
    for level in (1, 2, 3):
        compare(report, f"doc_dp2_mp2_pp2_l{level}", doc_model, DOC_VOCAB, mesh,
                {"dp_config": {"sharding_level": level}, "mp_config": doc_tensor_plan(True), "pp_config": {
                    "split_spec": "llama.layers", "accumulate_steps": 2, "loss_fn": cross_entropy}},
                model_loss, ref_loss=user_loop)


RUNS = {"doc_pp2": [doc_pp2, doc_pp2_cast, doc_pp2_scaled, doc_pp2_scaled_inf, doc_pp2_master_grad_hooks,
                    doc_pp2_bf16],  # bf16 last: it installs the emulated AMP
        "llama_pp2": [llama_pp2], "four": [llama_cp, llama_cp_uneven, llama_cp_returned_loss_weight, doc_mp2_pp2, doc_pp4],
        "eight": [doc_dp2_mp2_pp2]}


class _OneRanksError(RuntimeError):
    """What rank 3 raises on purpose (a peer's own error, e.g. gloo's, is not caught)."""


def raise_in_step(seconds):
    """set_timeout(seconds); one good step of Llama on pp2 x sep2; in the second, rank 3's loss raises inside
    the schedule (its forward on the last stage) and the rank stays alive, as a script catching the error
    would: its pipeline and ring peers must give up after the timeout. Rank 3 writes `raised.json`."""
    pcp.set_timeout(seconds)
    calls = []

    def loss_fn(output, labels):
        calls.append(1)
        if dist.get_rank() == 3 and len(calls) > 2:  # the second step's first micro-batch
            raise _OneRanksError("a loss that fails on one rank")
        return llama_loss(output, labels)

    model, optimizer = build(llama)
    config = {"cp_config": {"parallelize_plan": {"": pcp.PrepareContextParallel("p2p"),
                                                 "model.layers.*.self_attn": pcp.ContextParallel("p2p")}},
              "pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 2,
                            "loss_fn": loss_fn}}
    model, optimizer = pcp.parallelize(model, optimizer, pp_mesh([2, 2], ["pp", "sep"]), config)
    try:
        train(model, optimizer, 64, model_loss)
    except _OneRanksError as error:
        with open(os.path.join(os.environ["PCP_REPORT_DIR"], "raised.json"), "w") as f:
            json.dump({"time": time.time(), "rank": dist.get_rank(), "error": str(error)}, f)
        time.sleep(600)


def main(report):
    dist.init_parallel_env()
    for fn in RUNS[sys.argv[1]]:
        fn(report)



if __name__ == "__main__":
    if sys.argv[1] == "raise_in_step":
        dist.init_parallel_env()
        raise_in_step(float(sys.argv[2]))
    else:
        run(main)
