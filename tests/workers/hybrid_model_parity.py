"""Qwen3-Next (3 Gated DeltaNet layers + 1 full attention, 2 q/k heads repeated to 6 v heads) as users build it,
trained 3 AdamW steps under parallelize vs one process; the refusals of unrouted token mixers; a Conv1D model.

argv: runs "backend[:degree][:sdpa][:packed][:padded][:decoder][:fused_conv][:seq=S]", "layer:backend[:degree]:S[:recompute]"
(one GDN layer alone on an S-token sequence, optionally replayed by Paddle's recompute), "checks" (a Conv1D model; the refusals and the TokenWise declaration). The plan keys
ContextParallel on `self_attn` and `linear_attn` ("decoder": on each decoder layer instead); PrepareContextParallel
on the root, which splits labels too. "sdpa": built with that attention (the reference too: Qwen3-Next's eager
full attention, called with no mask, attends both ways, sdpa is causal); "packed": documents as
attn_mask_startend_row_indices (the GDN state flows across them, as on one card); "padded": a 2-D padding mask;
"fused_conv": both models call a `causal_conv1d_fn` (an emulation of the GPU kernel) instead of their conv1d.
Default length: 8N+3. Compared: the first forward's logits, losses, first-step gradients, final parameters, each
with the noise floor of the model itself (RECHUNKED below).
"""
import functools
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute
from paddleformers_models import build
from real_model_parity import STEPS, adamw, make_batch
from report import mean_over_ranks, run

import paddle_cp as pcp


def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None):
    """What causal-conv1d's kernel computes ([b, C, s], weight [C, k]): a depthwise causal conv, then SiLU."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[:, :, :x.shape[2]]
    return F.silu(out) if activation in ("silu", "swish") else out


# The noise floor: Qwen3-Next amplifies fp32 rounding (its gated RMSNorm rescales near-zero rows), so one card
# differs from itself by ~1e-5 when its own rule runs in another order. Measured with the rule chunked by these
# sizes instead of its 64 (the same arithmetic reordered; below the length, so short sequences reorder too).
RECHUNKED = (4, 8)


def qwen3_next(implementation, fused_conv, rule_chunk=None):
    """The model; `rule_chunk`: its rule re-chunked (the same arithmetic in another order: the noise floor)."""
    paddle.seed(2024)
    model = build("qwen3_next", _attn_implementation=implementation)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            if fused_conv:
                layer.linear_attn.causal_conv1d_fn = causal_conv1d_fn
            if rule_chunk:
                rule = layer.linear_attn.chunk_gated_delta_rule
                layer.linear_attn.chunk_gated_delta_rule = functools.partial(rule, chunk_size=rule_chunk)
    return model


def batch(spec):
    """real_model_parity's batch; Qwen3-Next multiplies hidden states by the padding mask: a float one."""
    ids, labels, extra = make_batch(spec["seq"], spec["padded"], spec["packed"])
    if "attention_mask" in extra:
        extra["attention_mask"] = extra["attention_mask"].astype("float32")
    return ids, labels, extra


def train(model, opt, step_loss):
    """(logits of the first forward, losses, first-step gradients, final parameters)."""
    logits, losses, grads = None, [], None
    for step in range(STEPS):
        loss, out = step_loss(model)
        loss.backward()
        opt.step()
        if step == 0:
            logits = out.numpy()
            grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        opt.clear_grad()
        losses.append(loss)
    return logits, losses, grads, {n: p.numpy() for n, p in model.named_parameters()}


def reference(spec, rule_chunk=None):
    model = qwen3_next(spec["implementation"], spec["fused_conv"], rule_chunk)
    ids, labels, extra = batch(spec)
    logits, losses, grads, params = train(model, adamw(model),
                                          lambda m: m(input_ids=ids, labels=labels, **extra)[:2])
    return logits, [float(x) for x in losses], grads, params


def parallel(spec, mesh):
    backend, degree = spec["backend"], spec["degree"]
    model = qwen3_next(spec["implementation"], spec["fused_conv"])
    opt = adamw(model)
    prepare = pcp.PrepareContextParallel(backend, degree)
    mixing = pcp.ContextParallel(backend, degree)
    keys = [r"model\.layers\.\d+"] if spec["decoder"] else ["model.layers.*.self_attn", "model.layers.*.linear_attn"]
    plan = {"": prepare, **{key: mixing for key in keys}}
    model, opt = pcp.parallelize(model, opt, mesh, {"cp_config": {"parallelize_plan": plan}})
    ids, labels, extra = batch(spec)
    local = pcp.shard_sequence(labels, backend=prepare, mesh=mesh, **documents_of(extra))  # as the batch is split
    weight = pcp.loss_weight(int((local != -100).sum()), mesh)

    def step_loss(m):
        loss, logits = m(input_ids=ids, labels=labels, **extra)[:2]
        return loss * weight, logits

    logits, losses, grads, params = train(model, opt, step_loss)
    return logits, mean_over_ranks(losses, mesh), grads, params, prepare


def documents_of(extra):
    """The document inputs a batch's split follows (packed documents: the layout balances them)."""
    return {key: extra[key] for key in ("attn_mask_startend_row_indices",) if key in extra}


def parse(spec, world):
    backend, *rest = spec.split(":")
    seq = next((int(x[4:]) for x in rest if x.startswith("seq=")), 8 * world + 3)
    return dict(backend=backend, degree=next((int(x) for x in rest if x.isdigit()), None), seq=seq,
                implementation="sdpa" if "sdpa" in rest else "eager", packed="packed" in rest,
                padded="padded" in rest, decoder="decoder" in rest, fused_conv="fused_conv" in rest)


def compare(report, name, spec, mesh, floors):
    ref_logits, ref_losses, ref_grads, ref_params = reference(spec)
    key = tuple(spec[k] for k in ("implementation", "fused_conv", "seq", "packed", "padded"))
    if key not in floors:  # one card against itself, its rule chunked otherwise: the model's own fp32 noise
        floors[key] = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0}
        for rule_chunk in RECHUNKED:
            f_logits, f_losses, f_grads, f_params = reference(spec, rule_chunk)
            for kind, value in (("logits", np.abs(f_logits - ref_logits).max()),
                                ("loss", np.abs(np.array(f_losses) - ref_losses).max()),
                                ("grad", max(relative(f_grads[n], g, g) for n, g in ref_grads.items())),
                                ("param", max(np.abs(f_params[n] - p).max() for n, p in ref_params.items()))):
                floors[key][kind] = max(floors[key][kind], float(value))
    report.value(f"{name}.floor", floors[key])

    logits, losses, grads, params, prepare = parallel(spec, mesh)
    report.diff(f"{name}.logits", logits, pcp.shard_sequence(paddle.to_tensor(ref_logits), backend=prepare, mesh=mesh,
                                                             **documents_of(batch(spec)[2])))
    report.value(f"{name}.losses", losses)
    report.diff(f"{name}.loss", np.array(losses), np.array(ref_losses))
    report.value(f"{name}.grads_compared", len(set(grads) & set(ref_grads)))
    for param, value in ref_grads.items():
        report.diff(f"{name}.grad", relative(grads[param], value, value), 0.0)

    for param, value in ref_params.items():
        report.diff(f"{name}.param", params[param], value)


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

    def __init__(self, rule_chunk=None, recompute=False):
        super().__init__()
        self.recompute = recompute  # the layer replayed in backward by Paddle's recompute
        paddle.seed(11)
        self.gdn = build("qwen3_next").model.layers[0].linear_attn
        if rule_chunk:
            self.gdn.chunk_gated_delta_rule = functools.partial(self.gdn.chunk_gated_delta_rule, chunk_size=rule_chunk)

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

    def one_card(rule_chunk=None):
        leaf = x.clone()
        leaf.stop_gradient = False
        layer = Holder(rule_chunk)
        out = layer(leaf)
        return out, gradients(layer, out, leaf, cotangent)

    want, want_grads = one_card()
    floor = {"out": 0.0, "grad": 0.0}
    for rule_chunk in RECHUNKED:
        out, grads = one_card(rule_chunk)
        floor["out"] = max(floor["out"], relative(out, want, want))
        floor["grad"] = max([floor["grad"]] + [relative(g, w, w) for g, w in zip(grads, want_grads)])
    layer = Holder(recompute=replayed)
    prepare = pcp.PrepareContextParallel(backend, degree)
    pcp.parallelize(layer, None, mesh, cp_config({"": prepare, "gdn": pcp.ContextParallel(backend, degree)}))
    got_x = x.clone()
    got_x.stop_gradient = False
    got = layer(hidden_states=got_x)
    shard = pcp.shard_sequence(cotangent, backend=prepare, mesh=mesh)
    got_grads = gradients(layer, got, got_x, shard)
    name = f"gdn_layer.{spec_text}"
    report.value(f"{name}.floor", floor)
    report.diff(f"{name}.out", relative(got, pcp.shard_sequence(want, backend=prepare, mesh=mesh), want), 0.0)
    for g, w in zip(got_grads, want_grads):  # each rank's share of a gradient: their sum is one card's
        total = g.clone()
        dist.all_reduce(total)
        report.diff(f"{name}.grad", relative(total, w, w), 0.0)


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
    attention = WithAttention()
    pcp.parallelize(attention, None, mesh, cp_config({"": pcp.PrepareContextParallel("p2p")}))
    report.expect_error("unrouted_sdpa", lambda: attention(ids))


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    names = []
    floors, layers = {}, []
    for spec_text in sys.argv[1:]:
        if spec_text == "checks":
            check_conv_model(report, mesh, world)
            check_refusals(report, mesh, world)
            continue
        if spec_text.startswith("layer:"):
            check_gdn_layer(report, mesh, spec_text[len("layer:"):])
            layers.append(spec_text[len("layer:"):])
            continue
        compare(report, spec_text, parse(spec_text, world), mesh, floors)
        names.append(spec_text)
    report.value("layers", layers)
    report.value("runs", names)


run(main)
