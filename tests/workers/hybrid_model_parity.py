"""Qwen3-Next (3 Gated DeltaNet layers + 1 full attention, 2 q/k heads repeated to 6 v heads) as users build it,
trained 3 AdamW steps under parallelize vs one process; the refusals of unrouted token mixers; a Conv1D model.

argv: runs "backend[:degree][:tp2][:sdpa][:packed][:padded][:decoder][:fused_conv][:seq=S]", "layer:backend[:degree]:S[:recompute]"
(one GDN layer alone on an S-token sequence, optionally replayed by Paddle's recompute), "checks" (a Conv1D model; the refusals and the TokenWise declaration). The plan keys
ContextParallel on `self_attn` and `linear_attn` ("decoder": on each decoder layer instead); PrepareContextParallel
on the root, which splits labels too. "sdpa": built with that attention (the reference too: Qwen3-Next's eager
full attention, called with no mask, attends both ways, sdpa is causal); "packed": documents as
attn_mask_startend_row_indices (the GDN state flows across them, as on one card); "padded": a 2-D padding mask;
"fused_conv": both models call a `causal_conv1d_fn` (an emulation of the GPU kernel) instead of their conv1d;
"tp2" (as the backend: tensor parallel alone, or after one: ranks paired on "mp", "sep" over the pairs): the
Trainer's tensor-parallel plan (tensor_parallel_plan) in mp_config.
Default length: 8 x sep + 3. Compared: the first forward's logits, losses, first-step gradients, final parameters, and
one card's and paddle_cp's distances from their float64 truth (paddle_cp/api/float64_truth.py), which the test
holds paddle_cp to (the model amplifies fp32 rounding: one card is ~1e-4 from the truth on logits).
"""
import contextlib
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute
from paddleformers_models import build, rechunked
from real_model_parity import STEPS, adamw, make_batch
from report import mean_over_ranks, run
from tensor_parallel import full_gradients

import paddle_cp as pcp
from paddle_cp.api.float64_truth import float64_math, float64_model, widened_inputs
from paddle_cp.integrations.paddleformers.plans import tensor_parallel_plan


def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None):
    """What causal-conv1d's kernel computes ([b, C, s], weight [C, k]): a depthwise causal conv, then SiLU."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[:, :, :x.shape[2]]
    return F.silu(out) if activation in ("silu", "swish") else out


def qwen3_next(implementation, fused_conv, second_evaluation=False):
    """The model; `second_evaluation`: its rule chunked otherwise (paddleformers_models.rechunked)."""
    paddle.seed(2024)
    model = build("qwen3_next", _attn_implementation=implementation)
    if fused_conv:
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.causal_conv1d_fn = causal_conv1d_fn
    return rechunked(model) if second_evaluation else model


def batch(spec):
    """real_model_parity's batch; Qwen3-Next multiplies hidden states by the padding mask: a float one."""
    ids, labels, extra = make_batch(spec["seq"], spec["padded"], spec["packed"])
    if "attention_mask" in extra:
        extra["attention_mask"] = extra["attention_mask"].astype("float32")
    return ids, labels, extra


def train(model, opt, step_loss, whole=False):
    """(logits of the first forward, losses, first-step gradients, final parameters); `whole`: gradients and
    parameters gathered from their tensor-parallel slices."""
    logits, losses, grads = None, [], None
    for step in range(STEPS):
        loss, out = step_loss(model)
        loss.backward()
        opt.step()
        if step == 0:
            logits = out.numpy()
            grads = full_gradients(model) if whole else {n: p.grad.numpy().copy() for n, p in model.named_parameters()
                                                          if p.grad is not None}
        opt.clear_grad()
        losses.append(loss)
    names = [n for n, _ in model.named_parameters()]
    params = pcp.full_state_dict(model) if whole else {n: p.numpy() for n, p in model.named_parameters()}
    return logits, losses, grads, {n: params[n] for n in names}


def reference(spec, float64=False, second_evaluation=False):
    """One card on the whole batch; `float64`: its truth, the same model (its fp32 initial values), batch and
    AdamW steps evaluated in float64."""
    model = qwen3_next(spec["implementation"], spec["fused_conv"], second_evaluation)
    ids, labels, extra = batch(spec)
    if float64:
        model, extra = float64_model(model), widened_inputs(extra, paddle.float64)
    with float64_math() if float64 else contextlib.nullcontext():
        logits, losses, grads, params = train(model, adamw(model),
                                              lambda m: m(input_ids=ids, labels=labels, **extra)[:2])
    return logits, [float(x) for x in losses], grads, params


def parallel(spec, mesh):
    """paddle_cp on `mesh`: ContextParallel on both mixers over "sep" (a backend given), the Trainer's tensor-parallel
    plan over "mp" (tp2); each rank's logits (its tokens; tensor parallel: every token)."""
    backend, degree = spec["backend"], spec["degree"]
    model = qwen3_next(spec["implementation"], spec["fused_conv"])
    opt = adamw(model)
    config, prepare, weight = {}, None, 1.0
    if backend:
        prepare = pcp.PrepareContextParallel(backend, degree)
        mixing = pcp.ContextParallel(backend, degree)
        keys = [r"model\.layers\.\d+"] if spec["decoder"] else ["model.layers.*.self_attn", "model.layers.*.linear_attn"]
        config["cp_config"] = {"parallelize_plan": {"": prepare, **{key: mixing for key in keys}}}
    if spec["tp"]:
        config["mp_config"] = {"parallelize_plan": tensor_parallel_plan(model, sequence_parallel=False)}
    model, opt = pcp.parallelize(model, opt, mesh, config)
    ids, labels, extra = batch(spec)
    if backend:
        local = pcp.shard_sequence(labels, backend=prepare, mesh=mesh, **documents_of(extra))  # as the batch is split
        weight = pcp.loss_weight(int((local != -100).sum()), mesh)

    def step_loss(m):
        loss, logits = m(input_ids=ids, labels=labels, **extra)[:2]
        return loss * weight, logits

    logits, losses, grads, params = train(model, opt, step_loss, whole=spec["tp"])
    return logits, mean_over_ranks(losses, mesh), grads, params, prepare


def mesh_of(spec, world):
    """"sep" over every rank; with tp2, "mp" pairs of ranks (and "sep" over the pairs when a backend is given)."""
    ranks = list(range(world))
    if not spec["tp"]:
        return dist.ProcessMesh(ranks, dim_names=["sep"])
    if not spec["backend"]:
        return dist.ProcessMesh(ranks, dim_names=["mp"])
    return dist.ProcessMesh(np.reshape(ranks, [world // 2, 2]).tolist(), dim_names=["sep", "mp"])


def documents_of(extra):
    """The document inputs a batch's split follows (packed documents: the layout balances them)."""
    return {key: extra[key] for key in ("attn_mask_startend_row_indices",) if key in extra}


def parse(spec, world):
    backend, *rest = spec.split(":")
    tp = "tp2" in (backend, *rest)
    sep = world // 2 if tp else world
    seq = next((int(x[4:]) for x in rest if x.startswith("seq=")), 8 * sep + 3)
    return dict(backend=None if backend == "tp2" else backend, tp=tp, seq=seq,
                degree=next((int(x) for x in rest if x.isdigit()), None),
                implementation="sdpa" if "sdpa" in rest else "eager", packed="packed" in rest,
                padded="padded" in rest, decoder="decoder" in rest, fused_conv="fused_conv" in rest)


def compare(report, name, spec, references):
    """paddle_cp's and one card's distances from the float64 truth, on this rank's tokens (logits) and every
    loss, gradient and parameter; paddle_cp's differences from one card for the record."""
    key = tuple(spec[k] for k in ("implementation", "fused_conv", "seq", "packed", "padded"))
    if key not in references:  # one card (two evaluations) and the truth, once per distinct batch
        references[key] = (reference(spec), reference(spec, second_evaluation=True)), reference(spec, float64=True)
    (one_card, rechunked), truth = references[key]
    mesh = mesh_of(spec, dist.get_world_size())
    logits, losses, grads, params, prepare = parallel(spec, mesh)
    docs = documents_of(batch(spec)[2])
    tokens = (lambda full: pcp.shard_sequence(paddle.to_tensor(full), backend=prepare, mesh=mesh, **docs).numpy()
              ) if prepare else (lambda full: full)
    truth = (tokens(truth[0]), *truth[1:])  # logits: all on this rank's tokens
    report.value(f"{name}.truth", {
        "one_card": distances((tokens(one_card[0]), *one_card[1:]), truth),
        "rechunked": distances((tokens(rechunked[0]), *rechunked[1:]), truth),
        "paddle_cp": distances((logits, losses, grads, params), truth)})
    report.diff(f"{name}.logits", logits, tokens(one_card[0]))
    report.value(f"{name}.losses", losses)
    report.diff(f"{name}.loss", np.array(losses), np.array(one_card[1]))
    report.value(f"{name}.grads_compared", len(set(grads) & set(one_card[2])))
    for param, value in one_card[2].items():
        report.diff(f"{name}.grad", relative(grads[param], value, value), 0.0)
    for param, value in one_card[3].items():
        report.diff(f"{name}.param", params[param], value)


def distances(run, truth):
    """A run's largest differences from the truth: (logits, losses, first-step gradients (relative, see
    `relative`), final parameters)."""
    (logits, losses, grads, params), (t_logits, t_losses, t_grads, t_params) = run, truth
    return {"logits": float(np.abs(logits - t_logits).max()),
            "loss": float(np.abs(np.array(losses) - t_losses).max()),
            "grad": max(relative(grads[n], g, g) for n, g in t_grads.items()),
            "param": max(float(np.abs(params[n] - p).max()) for n, p in t_params.items())}


# ---- refusals and the declaration ------------------------------------------------------------------

class Mixer(paddle.nn.Layer):
    """Embedding, one sequence-mixing (or token-wise) layer, a head: [b, s] ids -> [b, s, 32] logits."""

    def __init__(self, kind):
        super().__init__()
        self.embed = paddle.nn.Embedding(32, 16)
        self.kind = kind
        if kind == "lstm":
            self.mix = paddle.nn.LSTM(16, 16)
        elif kind == "channel_conv":  # mixes the 16 channels of each token, over a [b*s, 1, 16] view
            self.mix = paddle.nn.Conv1D(1, 1, 3, padding=1)
        else:  # a causal conv (padding k-1, first s kept) and a dilated 'same' conv over the sequence
            self.mix = paddle.nn.Conv1D(16, 16, 4, padding=3)
            self.same = paddle.nn.Conv1D(16, 16, 3, padding=2, dilation=2, data_format="NLC")
        self.head = paddle.nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.embed(input_ids)  # [b, s, 16]
        b, s, c = x.shape
        if self.kind == "lstm":
            x = self.mix(x)[0]
        elif self.kind == "channel_conv":
            x = self.mix(x.reshape([b * s, 1, c])).reshape([b, s, c])
        else:
            x = F.silu(self.mix(x.transpose([0, 2, 1]))[:, :, :s]).transpose([0, 2, 1])  # [b, s, 16]
            x = x + self.same(x)
        return self.head(x)


class LocalAttention(paddle.nn.Layer):
    """Calls SDPA from a layer no plan routes."""

    def forward(self, x):
        q = x.reshape([x.shape[0], x.shape[1], 2, 8])
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(x.shape)


class WithAttention(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = paddle.nn.Embedding(32, 16)
        self.attn = LocalAttention()

    def forward(self, input_ids):
        return self.attn(self.embed(input_ids))


class Holder(paddle.nn.Layer):
    """One Gated DeltaNet layer of the tiny Qwen3-Next, as the top layer PrepareContextParallel splits."""

    def __init__(self, recompute=False):
        super().__init__()
        self.recompute = recompute  # the layer replayed in backward by Paddle's recompute
        paddle.seed(11)
        self.gdn = build("qwen3_next").model.layers[0].linear_attn

    def forward(self, hidden_states):
        if self.recompute:
            return recompute(self.gdn, hidden_states)
        return self.gdn(hidden_states)


def check_gdn_layer(report, mesh, spec_text):
    """One GDN layer alone (no model amplifying fp32 rounding): outputs, input and parameter gradients.
    spec_text: "backend[:degree]:seq[:recompute]"."""
    backend, *rest = spec_text.split(":")
    replayed = rest[-1] == "recompute"
    numbers = [int(x) for x in rest if x.isdigit()]
    degree, seq = numbers if len(numbers) == 2 else (None, numbers[0])
    paddle.seed(5)
    x = paddle.randn([2, seq, 64])
    cotangent = paddle.randn([2, seq, 64])

    def gradients(layer, out, leaf, dout):  # backward(), not paddle.grad: recompute fills .grad only
        (out * dout).sum().backward()
        return [leaf.grad, *(p.grad for p in layer.parameters())]

    def one_card(float64=False):  # its truth: the layer's fp32 initial values, input and cotangent in float64
        layer = float64_model(Holder()) if float64 else Holder()
        leaf, dout = (x.astype("float64"), cotangent.astype("float64")) if float64 else (x.clone(), cotangent)
        leaf.stop_gradient = False
        with float64_math() if float64 else contextlib.nullcontext():
            out = layer(leaf)
            return out, gradients(layer, out, leaf, dout)

    want, want_grads = one_card()
    truth, truth_grads = one_card(float64=True)
    layer = Holder(recompute=replayed)
    prepare = pcp.PrepareContextParallel(backend, degree)
    pcp.parallelize(layer, None, mesh, cp_config({"": prepare, "gdn": pcp.ContextParallel(backend, degree)}))
    got_x = x.clone()
    got_x.stop_gradient = False
    got = layer(hidden_states=got_x)
    shard = pcp.shard_sequence(cotangent, backend=prepare, mesh=mesh)
    got_grads = []
    for g in gradients(layer, got, got_x, shard):  # each rank's share of a gradient: their sum is one card's
        total = g.clone()
        dist.all_reduce(total)
        got_grads.append(total)
    tokens = lambda full: pcp.shard_sequence(full, backend=prepare, mesh=mesh)
    name = f"gdn_layer.{spec_text}"
    report.value(f"{name}.truth", {
        who: {"out": relative(local_out, tokens(truth), truth),
              "grad": max(relative(g, t, t) for g, t in zip(grads, truth_grads))}
        for who, local_out, grads in (("one_card", tokens(want), want_grads), ("paddle_cp", got, got_grads))})
    report.diff(f"{name}.out", relative(got, tokens(want), want), 0.0)
    for g, w in zip(got_grads, want_grads):
        report.diff(f"{name}.grad", relative(g, w, w), 0.0)


def relative(got, want, whole):
    """Largest difference, relative to the whole tensor's largest value where that exceeds 1 (parameter
    gradients sum over every token)."""
    got, want, whole = (np.asarray(x.numpy() if hasattr(x, "numpy") else x) for x in (got, want, whole))
    return float(np.abs(got - want).max()) / max(1.0, float(np.abs(whole).max()))


def cp_config(plan):
    return {"cp_config": {"parallelize_plan": plan}}


def check_conv_model(report, mesh, world):
    """A causal and a dilated 'same' Conv1D over the sequence, routed by ContextParallel: equal to one card
    on a length whose chunks are shorter than the kernels' reach."""
    seq = 2 * world + 1
    paddle.seed(7)
    ids = paddle.randint(0, 32, [2, seq])
    paddle.seed(3)
    model = Mixer("conv")
    ref = model(ids)
    cotangent = paddle.randn(ref.shape)
    ref_grads = paddle.grad([ref], [model.mix.weight, model.same.weight], [cotangent])
    plan = {"": pcp.PrepareContextParallel("p2p"), "mix": pcp.ContextParallel("p2p"), "same": pcp.ContextParallel("p2p")}
    pcp.parallelize(model, None, mesh, cp_config(plan))
    shard = pcp.shard_sequence(cotangent, mesh=mesh)
    out = model(ids)
    grads = paddle.grad([out], [model.mix.weight, model.same.weight], [shard])
    report.diff("conv_model.out", out, pcp.shard_sequence(ref, mesh=mesh))
    for got, want in zip(grads, ref_grads):  # each rank's share of the weight gradients sums to one card's
        total = got.clone()
        dist.all_reduce(total)
        report.diff("conv_model.grad", total, want)


def check_refusals(report, mesh, world):
    prepare = pcp.PrepareContextParallel("p2p")
    report.expect_error("self_attn_only", lambda: pcp.parallelize(
        build("qwen3_next"), None, mesh,
        cp_config({"": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")})))
    report.expect_error("attention_outside", lambda: pcp.parallelize(
        build("qwen3_next"), None, mesh,
        cp_config({"": prepare, "model.layers.*.linear_attn": pcp.ContextParallel("p2p")})))
    report.expect_error("lstm", lambda: pcp.parallelize(Mixer("lstm"), None, mesh, cp_config({"": prepare})))
    report.expect_error("lstm_routed", lambda: pcp.parallelize(
        Mixer("lstm"), None, mesh, cp_config({"": prepare, "mix": pcp.ContextParallel("p2p")})))
    report.expect_error("conv1d", lambda: pcp.parallelize(Mixer("conv"), None, mesh, cp_config({"": prepare})))
    report.expect_error("conv1d_script_split", lambda: pcp.parallelize(  # no Prepare: the script splits its inputs
        Mixer("conv"), None, mesh, cp_config({"same": pcp.ContextParallel("p2p")})))
    report.expect_error("nested", lambda: pcp.parallelize(
        Mixer("conv"), None, mesh,
        cp_config({"": [prepare, pcp.ContextParallel("p2p")], "mix": pcp.ContextParallel("p2p")})))
    ids = paddle.randint(0, 32, [2, 2 * world + 1])
    channel = Mixer("channel_conv")
    report.expect_error("token_wise", lambda: pcp.parallelize(channel, None, mesh,
                                                              cp_config({"": prepare, "mix": pcp.TokenWise()})))
    channel_out = channel(ids)
    report.value("token_wise.local_len", channel_out.shape[1])
    split_gdn = {"model.layers.*.linear_attn.in_proj_qkvz": pcp.ColWiseParallel(),
                 "model.layers.*.linear_attn.out_proj": pcp.RowWiseParallel()}
    report.expect_error("tp_inside_gdn", lambda: pcp.parallelize(
        build("qwen3_next"), None, dist.ProcessMesh(list(range(world)), dim_names=["mp"]),
        {"mp_config": {"parallelize_plan": split_gdn}}))
    attention = WithAttention()
    pcp.parallelize(attention, None, mesh, cp_config({"": pcp.PrepareContextParallel("p2p")}))
    report.expect_error("unrouted_sdpa", lambda: attention(ids))


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    names = []
    references, layers = {}, []
    for spec_text in sys.argv[1:]:
        if spec_text == "checks":
            check_conv_model(report, mesh, world)
            check_refusals(report, mesh, world)
            continue
        if spec_text.startswith("layer:"):
            check_gdn_layer(report, mesh, spec_text[len("layer:"):])
            layers.append(spec_text[len("layer:"):])
            continue
        compare(report, spec_text, parse(spec_text, world), references)
        names.append(spec_text)
    report.value("layers", layers)
    report.value("runs", names)


run(main)
