"""MoE models of three families trained 3 AdamW steps under ep_config vs one card on the global batch:
Qwen3-MoE (listed experts; also its stacked `fd_fallback` form), DeepSeek-V3 (shared + routed experts,
one expert no token reaches: one card runs it on a zero row, AdamW decays it) and gpt-oss (stacked
experts, its aux loss in the training loss); Qwen2-MoE and GLM4-MoE (whose idle expert does not run); how much of the routed experts each rank holds; and the bad
configs' errors, raised on every rank before any collective.

argv: runs "family:layout[:recompute][:lazy][:levelN][:tiled]" (levelN: dp_config sharding_level N, which shards
the experts over the ranks holding the same ones; tiled: the shared experts under SequenceTiled), and "root=DIR": pretrained weights in and out, checkpoints
(weights_and_checkpoints). Expert counts do not divide the degrees: ranges are uneven.
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddleformers_models import SIZES, stub_gpu_modules
from paddleformers_models import build as build_family
from pipeline import as_fp32, cast_after_parallelize
from report import mean_over_ranks, run

import paddle_cp as pcp
import paddle_cp.integrations.paddleformers  # noqa: F401 - its MoE blocks known before parallelize meets one
from paddle_cp.experts.blocks import find_moe_block
from paddle_cp.experts.layout import ExpertLayout
from paddle_cp.mesh import fold_groups
from paddle_cp.params import record_of
from paddle_cp.tools.memory.io_phases import measure

STEPS = 3
TILE = 4  # rows per SequenceTiled tile of the shared experts ("tiled" runs)
BATCH, SEQ = 4, 19
AUX_COEF = 0.5  # large enough that an aux loss from the wrong statistics shows in every gradient
IDLE_EXPERT = 4  # no token reaches it (keep_away_from_idle_expert)
EXPERT_TP = {"model.layers.*.mlp.experts.*.up_gate_proj": pcp.ColWiseParallel(),
             "model.layers.*.mlp.experts.*.down_proj": pcp.RowWiseParallel()}
PIPELINE = {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "schedule_mode": "1F1B",
            "accumulate_steps": 2}
LAYOUTS = {  # mesh, context-parallel backend, expert degree, other config sections
    "dp2xsep2": ([("dp", 2), ("sep", 2)], "p2p", 4, {}),
    "sep4": ([("sep", 4)], "all2all", 2, {}),
    "dp4": ([("dp", 4)], None, 4, {}),
    "dp2xmp2": ([("dp", 2), ("mp", 2)], None, 2, {"mp_config": {"parallelize_plan": EXPERT_TP}}),
    "pp2xsep2": ([("pp", 2), ("sep", 2)], "p2p", 2, {"pp_config": PIPELINE}),
    # dims of size 1 with their configs (the mesh sweep's rule, with experts)
    "mp1xdp2xsep2": ([("mp", 1), ("dp", 2), ("sep", 2)], "p2p", 4, {"mp_config": {"parallelize_plan": EXPERT_TP}}),
    "sep4xdp1xpp1": ([("sep", 4), ("dp", 1), ("pp", 1)], "all2all", 2, {"pp_config": PIPELINE}),
}
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, use_cache=False)


def build(family, recompute=False):
    stub_gpu_modules()
    import paddleformers.transformers as pf

    extra = {**(RECOMPUTE if recompute else {}), "dtype": "float32"}  # also what save_pretrained writes
    if family.startswith("qwen3_moe"):  # softmax top-k router; its model drops the router logits: no aux loss
        return build_family("qwen3_moe", **extra, fd_fallback=family.endswith("stacked"))
    if family == "qwen2_moe":  # softmax router, a shared expert behind a sigmoid gate
        from paddleformers.transformers.qwen2_moe.modeling import Qwen2MoeForCausalLMDeprecated

        return Qwen2MoeForCausalLMDeprecated(pf.Qwen2MoeConfig(
            **SIZES, **extra, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48))
    if family == "glm4_moe":  # sigmoid group router, shared expert, layer 0 dense; idle experts do not run
        from paddleformers.transformers.glm4_moe.modeling import Glm4MoeForCausalLMDeprecated

        return keep_away_from_idle_expert(Glm4MoeForCausalLMDeprecated(pf.Glm4MoeConfig(
            **SIZES, **extra, head_dim=16, n_routed_experts=5, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=32, first_k_dense_replace=1)))
    if family == "deepseek_v3":  # sigmoid group router, layer 0 dense
        return keep_away_from_idle_expert(pf.DeepseekV3ForCausalLM(pf.DeepseekV3Config(
            **{**SIZES, "num_key_value_heads": 4}, **extra, head_dim=8, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=5, n_shared_experts=1,
            num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
            topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
            rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=64, beta_fast=32.0,
                              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))))
    if family == "gpt_oss":  # dense routing weights, biases in the experts
        return pf.GptOssForCausalLM(pf.GptOssConfig(
            **SIZES, **extra, head_dim=16, num_local_experts=5, num_experts_per_tok=2, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"], output_router_logits=True,
            router_aux_loss_coef=AUX_COEF))
    raise ValueError(family)


def keep_away_from_idle_expert(model):
    """The routers' correction bias (DeepSeek-V3, GLM4-MoE) keeps every token away from expert IDLE_EXPERT."""
    for layer in model.model.layers[1:]:  # layer 0 is dense
        bias = np.zeros(layer.mlp.gate.e_score_correction_bias.shape, "float32")
        bias[IDLE_EXPERT] = -100.0
        layer.mlp.gate.e_score_correction_bias.set_value(bias)
    return model


def made(family, recompute=False, lazy=False):
    paddle.seed(2024)
    if not lazy:
        return build(family, recompute)
    with paddle.LazyGuard():
        return build(family, recompute)


def keep_router_scores(model):
    """gpt-oss's decoder layer drops its MLP's router scores (`hidden, _ = self.mlp(...)`), so with
    output_router_logits its aux loss fails even on one card in PaddleFormers 1.2.0 (HF's gpt-oss records
    them). Hand them on as the layer's code expects (a tuple in the first output): the aux loss is then in
    the training loss as the family means it to be."""
    if getattr(model.config, "output_router_logits", False):
        for layer in model.model.layers:
            layer.mlp.register_forward_post_hook(lambda mlp, inputs, out: ((out[0], out[1]), out[1]))


def adamw(model):
    return paddle.optimizer.AdamW(learning_rate=1e-2, weight_decay=0.1, epsilon=1e-3, parameters=model.parameters())


def batch():
    paddle.seed(7)
    ids = paddle.randint(0, 128, [BATCH, SEQ + 1])
    return ids[:, :-1], ids[:, 1:]


def step_outputs(out):
    """(loss, aux loss or None, logits or None) of a model call (a pipeline's returns the loss alone)."""
    if not hasattr(out, "get"):
        return out[0] if isinstance(out, (tuple, list)) else out, None, None
    aux = out.get("aux_loss")
    return out.loss, (aux.numpy() if isinstance(aux, paddle.Tensor) else None), out.logits.numpy()


def reference(family, lazy):
    ids, labels = batch()
    model = made(family, lazy=lazy)
    if lazy:
        for param in model.parameters():
            param.initialize()
    keep_router_scores(model)
    initial = {k: v.numpy() for k, v in model.state_dict().items()}
    opt = adamw(model)
    losses, first = [], None
    for _ in range(STEPS):
        loss, aux, logits = step_outputs(model(input_ids=ids, labels=labels, return_dict=True))
        first = first or (aux, logits)
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.clear_grad()
    return losses, first, initial, {k: v.numpy() for k, v in model.state_dict().items()}


def routed_expert_sizes(model):
    """(elements of routed-expert parameters this rank holds, their single-card total)."""
    held = total = 0
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            total += int(np.prod(pcp_full_shape(param)))
            held += int(np.prod(param.shape)) if param._is_initialized() else 0
    return held, total


def pcp_full_shape(param):
    return record_of(param).full_shape


def expected_share(model, degree, group_index, tp):
    """Elements this rank should hold: its contiguous range of each block's experts (split over `tp` mp ranks)."""
    share = 0
    for name, layer in model.named_sublayers():
        experts = getattr(layer, "experts", None)
        on_stage = experts is not None and record_of(next(
            p for n, p in layer.named_parameters() if not n.startswith("experts."))).held_here()
        if name.endswith(".mlp") and on_stage:  # a pipeline stage holds its own layers' experts only
            count = len(experts) if isinstance(experts, paddle.nn.LayerList) else pcp_full_shape(
                next(iter(experts.parameters())))[0]
            start, stop = ExpertLayout(count, degree).range_of(group_index)
            share += sum(int(np.prod(pcp_full_shape(p))) for p in experts.parameters()) * (stop - start) // (count * tp)
    return share


def local_tokens(tensor, backend, mesh):
    """This rank's tokens of a [b, s, ...] tensor (all of them without context parallelism)."""
    return pcp.shard_sequence(tensor, backend=backend, mesh=mesh) if backend else tensor


def weighted_loss(model, weight):
    """pp_config's loss_fn: the model's own criterion on a micro-batch's logits, times this rank's loss weight."""
    def loss_fn(output, labels):
        logits = output[0] if isinstance(output, (tuple, list)) else output.logits
        return model.criterion(logits, labels)[0] * weight
    return loss_fn


class Run:
    """A model of `family` parallelized on `layout`, with its optimizer and this rank's batch."""

    def __init__(self, family, layout, recompute=False, lazy=False, level=0, tiled=False):
        dims, self.backend, self.degree, sections = LAYOUTS[layout]
        world = dist.get_world_size()
        self.dims, self.mesh = dims, dist.ProcessMesh(np.arange(world).reshape([n for _, n in dims]).tolist(),
                                                      dim_names=[d for d, _ in dims])
        self.ids, self.labels = pcp.shard_batch(batch(), mesh=self.mesh)  # first: it seeds; a lazy model draws later
        model = made(family, recompute, lazy)
        config = {"ep_config": {"degree": self.degree,
                                "parallelize_plan": {"model.layers.*.mlp": pcp.ExpertParallel()}},
                  "dp_config": {"sharding_level": level}, **sections}
        if self.backend:
            config["cp_config"] = {"parallelize_plan": {  # "": the model itself, its labels split too
                "": pcp.PrepareContextParallel(self.backend),
                "model.layers.*.self_attn": pcp.ContextParallel(self.backend)}}
        if tiled:  # the MoE blocks' dense part (their shared experts) in tiles of TILE rows
            config.setdefault("cp_config", {"parallelize_plan": {}})["parallelize_plan"][
                f"model.layers.*.mlp.{shared_experts(model)}"] = pcp.SequenceTiled(tokens=TILE)
        self.weight = pcp.loss_weight(int(self.local(self.labels).numel()), self.mesh)
        if "pp_config" in config:  # each micro-batch's loss weighted before its backward, which runs in the schedule
            config["pp_config"] = {**config["pp_config"], "loss_fn": weighted_loss(model, self.weight)}
            self.weight = 1.0
        self.model, self.opt = pcp.parallelize(model, adamw(model), self.mesh, config)
        if lazy:
            for param in self.model.parameters():
                param.initialize()
        keep_router_scores(self.model)  # after parallelize's hooks: the gathered scores are handed on

    def local(self, tensor):
        return local_tokens(tensor, self.backend, self.mesh)

    def train(self, steps):
        """(global losses, (aux, logits) of the first step)."""
        losses, first = [], None
        for _ in range(steps):
            loss, aux, logits = step_outputs(self.model(input_ids=self.ids, labels=self.labels, return_dict=True))
            first = first or (aux, logits)
            loss = loss * self.weight
            losses.append(loss)  # mp, pp copies equal: their mean over the mesh is the dp x sep mean
            loss.backward()
            self.opt.step()
            self.opt.clear_grad()
        return mean_over_ranks(losses, self.mesh), first

    def held(self):
        """[routed-expert elements held here, their single-card total, this rank's expected share]."""
        position = fold_groups(self.mesh, ["dp", "sep"], self.degree)[0].index  # made by parallelize: no new group
        return [*routed_expert_sizes(self.model),
                expected_share(self.model, self.degree, position, dict(self.dims).get("mp", 1))]


def weights_and_checkpoints(report, root, references):
    """load_pretrained of what save_pretrained wrote (the test, one card) into a lazily built dp2 x sep2 E=4 model,
    export_pretrained back out (the test compares the files), for listed (DeepSeek-V3) and stacked (gpt-oss)
    experts; a checkpoint saved there after one step resumed on sep4 E=2 for two more steps."""
    for family in ("deepseek_v3", "gpt_oss"):
        want = np.load(os.path.join(root, f"{family}.npz"))  # from_pretrained on one card (the test's process)
        with paddle.LazyGuard():  # no values: only loading gives them (the fine-tuning recipe)
            source = Run(family, "dp2xsep2")
        row = measure("load_pretrained", lambda: pcp.load_pretrained(source.model, os.path.join(root, family)),
                      source.model)
        report.value(f"io.{family}.load_pretrained", row)
        loaded = pcp.full_state_dict(source.model)
        for key, value in loaded.items():
            report.diff(f"io.{family}.loaded", value, want[key])
        report.value(f"io.{family}.differing", sorted(k for k, v in loaded.items() if not np.array_equal(v, want[k])))
        row = measure("export", lambda: pcp.export_pretrained(source.model, os.path.join(root, f"export_{family}")),
                      source.model)
        report.value(f"io.{family}.export", row)

        resumed = Run(family, "dp2xsep2")  # one card's start again
        first, _ = resumed.train(1)
        checkpoint = os.path.join(root, f"checkpoint_{family}")
        pcp.save_checkpoint(checkpoint, resumed.model, resumed.opt)
        target = Run(family, "sep4")
        pcp.load_checkpoint(checkpoint, target.model, target.opt)
        rest, _ = target.train(STEPS - 1)
        want_losses, _, _, want_state = references(family)
        report.diff(f"ckpt.{family}.loss", np.array(first + rest), np.array(want_losses))
        for key, value in pcp.full_state_dict(target.model).items():
            report.diff(f"ckpt.{family}.param", value, want_state[key])


def check_bad_configs(report):
    """Each must raise the same error on every rank before any collective."""
    stub_gpu_modules()
    world = dist.get_world_size()
    dp_sep = dist.ProcessMesh(np.arange(world).reshape([2, 2]).tolist(), dim_names=["dp", "sep"])
    dp_mp = dist.ProcessMesh(np.arange(world).reshape([2, 2]).tolist(), dim_names=["dp", "mp"])
    plan = {"model.layers.*.mlp": pcp.ExpertParallel()}
    cases = {
        "degree_not_dividing": (dp_sep, {"ep_config": {"degree": 3, "parallelize_plan": plan}}),
        "degree_beyond_experts": (dp_sep, {"ep_config": {"degree": 4, "parallelize_plan": plan}}, 3),
        "key_not_moe": (dp_sep, {"ep_config": {"degree": 2, "parallelize_plan": {
            "model.layers.*.self_attn": pcp.ExpertParallel()}}}),
        "key_matches_nothing": (dp_sep, {"ep_config": {"degree": 2, "parallelize_plan": {
            "model.blocks.*.mlp": pcp.ExpertParallel()}}}),
        "mp_in_group": (dp_mp, {"ep_config": {"degree": 4, "mesh_dims": ["dp", "mp"], "parallelize_plan": plan}}),
        "in_mp_config": (dp_sep, {"mp_config": {"parallelize_plan": plan}}),
        "aux_loss_without_ep": (dp_sep, {"cp_config": {"parallelize_plan": {
            "": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}}}),
        "tiled_moe_block": (dp_sep, {"cp_config": {"parallelize_plan": {
            "model.layers.1.mlp": pcp.SequenceTiled(tokens=TILE)}}}),
    }
    special = {"aux_loss_without_ep": "gpt_oss", "tiled_moe_block": "deepseek_v3"}
    for name, (mesh, config, *experts) in cases.items():
        model = build(special[name]) if name in special else (
            build("qwen3_moe") if not experts else _qwen3_with_experts(experts[0]))
        report.expect_error(f"bad.{name}", lambda: pcp.parallelize(model, None, mesh, config))
    model, _ = pcp.parallelize(build("qwen3_moe"), None, dp_sep, cases["aux_loss_without_ep"][1])  # config: no aux loss
    report.expect_error("bad.aux_loss_keyword_without_ep", lambda: model(
        input_ids=paddle.randint(0, 10, [2, 9]), output_router_logits=True))


def shared_experts(model):
    """The attribute name of the model's MoE blocks' shared experts."""
    block = next(block for layer in model.sublayers() if (block := find_moe_block(layer)) is not None)
    return block.shared_experts()[0]


def count_calls(layers):
    """A list that grows by one per forward of any of `layers`."""
    calls = []
    for layer in layers:
        layer.register_forward_post_hook(lambda *_: calls.append(1))
    return calls


def _qwen3_with_experts(count):
    import paddleformers.transformers as pf
    from paddleformers.transformers.qwen3_moe.modeling import Qwen3MoeForCausalLMDeprecated

    return Qwen3MoeForCausalLMDeprecated(pf.Qwen3MoeConfig(
        **SIZES, head_dim=16, num_experts=count, num_experts_per_tok=2, moe_intermediate_size=32))


def bf16_experts(report, spec):
    """bf16 O2 under the emulated AMP (tests/workers/emulated_amp.py; installed for the rest of the process: the
    last specs): one card's bf16 run and the expert-parallel one (decorate after parallelize: other ranks' experts
    are placeholders) against one card's fp32 run, STEPS steps: losses and every parameter (fp32 values)."""
    import emulated_amp

    family, layout = spec.split(":")[:2]
    emulated_amp.install()
    o2 = dict(level="O2", dtype="bfloat16")

    def steps(model, optimizer, ids, labels, amp, weight=1.0):
        losses = []
        for _ in range(STEPS):
            with paddle.amp.auto_cast(amp, **o2):
                loss = step_outputs(model(input_ids=ids, labels=labels, return_dict=True))[0] * weight
            losses.append(loss)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
        emulated_amp.reset()
        return losses

    def one_card(amp):
        model = made(family)
        keep_router_scores(model)
        optimizer = adamw(model)
        if amp:
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, **o2)
        losses = steps(model, optimizer, *batch(), amp)
        return np.array([float(x) for x in losses]), {k: as_fp32(v.numpy()) for k, v in model.state_dict().items()}

    fp32_losses, fp32_state = one_card(False)
    for name, (losses, state) in {"one_card": one_card(True)}.items():
        report.diff(f"{spec}.{name}.loss", losses, fp32_losses)
        for key, value in fp32_state.items():
            report.diff(f"{spec}.{name}.param.{key}", state[key], value)
    run_ = Run(family, layout)
    run_.model, run_.opt = paddle.amp.decorate(models=run_.model, optimizers=run_.opt, **o2)
    losses = mean_over_ranks(steps(run_.model, run_.opt, run_.ids, run_.labels, True, run_.weight), run_.mesh)
    state = {k: as_fp32(v) for k, v in pcp.full_state_dict(run_.model).items()}
    report.diff(f"{spec}.parallel.loss", np.array(losses), fp32_losses)
    for key, value in fp32_state.items():
        report.diff(f"{spec}.parallel.param.{key}", state[key], value)


# runs whose model is then cast as decorate(level="O2") casts it: listed experts held by one rank (with a
# pipeline too), stacked experts sharded at level 3 (their shares kept by owners only)
CAST_AFTER = ("qwen3_moe:dp2xsep2", "deepseek_v3:sep4", "qwen3_moe:pp2xsep2", "gpt_oss:sep4:level3")


def main(report):
    check_bad_configs(report)  # first: a rank that went on to a collective would hang the others
    cached = {}

    def references(family, lazy=False):
        if (family, lazy) not in cached:
            cached[family, lazy] = reference(family, lazy)
        return cached[family, lazy]

    for spec in sys.argv[1:]:
        if spec.startswith("root="):
            weights_and_checkpoints(report, spec[len("root="):], references)
            continue
        if spec.endswith(":bf16"):
            bf16_experts(report, spec)
            continue
        family, layout, *options = spec.split(":")
        lazy = "lazy" in options
        want_losses, (want_aux, want_logits), initial, want_state = references(family, lazy)
        level = next((int(o[len("level"):]) for o in options if o.startswith("level")), 0)
        run_ = Run(family, layout, "recompute" in options, lazy, level, "tiled" in options)
        report.value(f"{spec}.held", run_.held())
        if "tiled" in options:  # each tile runs the shared experts' down projection once forward, once replayed
            name = shared_experts(run_.model)
            downs = [layer for key, layer in run_.model.named_sublayers() if key.endswith(f"mlp.{name}.down_proj")]
            tile_calls = count_calls(downs)
            report.value(f"{spec}.expected_tile_calls",
                         STEPS * len(downs) * 2 * -(-int(run_.local(run_.labels).numel()) // TILE))
        losses, (aux, logits) = run_.train(STEPS)
        if "tiled" in options:
            report.value(f"{spec}.tile_calls", len(tile_calls))
        state = pcp.full_state_dict(run_.model)
        report.value(f"{spec}.losses", losses)
        report.diff(f"{spec}.loss", np.array(losses), np.array(want_losses))
        if want_aux is not None:
            report.diff(f"{spec}.aux", aux, want_aux)
        if logits is not None:
            report.diff(f"{spec}.logits", logits, run_.local(pcp.shard_batch(paddle.to_tensor(want_logits),
                                                                              mesh=run_.mesh)))
        report.value(f"{spec}.keys_match", sorted(state) == sorted(want_state))
        for key, value in want_state.items():
            report.diff(f"{spec}.param", state[key], value)
        if family in ("deepseek_v3", "glm4_moe"):  # the expert no token reached moved (or not) as on one card
            key = f"model.layers.1.mlp.experts.{IDLE_EXPERT}.down_proj.weight"
            report.value(f"{spec}.idle_moved", [float(np.abs(state[key] - initial[key]).max()),
                                                float(np.abs(want_state[key] - initial[key]).max())])
        if spec in CAST_AFTER:  # last: the model is bf16 after it
            cast_after_parallelize(report, spec, run_.model)


if __name__ == "__main__":
    run(main)
