"""PaddleFormers vision-language models as users build them, trained 3 AdamW steps with the plan users write
({"": PrepareContextParallel, "<language model>.layers.*.self_attn": ContextParallel}, every rank passing the whole
batch) vs one process on the same batch.

argv: the runs, each "family:backend[:degree][:inner|:language][:split][:frozen][:l1|:l2|:l3]:kind" (kind: images,
rows, video, packed, text; vl_models.batch_of): lengths 2N does not divide; losses weighted by each rank's labelled tokens (its labels split by
shard_sequence after the forward, in the batch's layout). "inner": PrepareContextParallel keyed on the inner model
that merges (Paddle's spelling), "language": on the language model, the labels split before the forward;
"split": ContextParallel on the vision tower too (split by images), "frozen": the tower not trained, "l3": sharding
level 3 over the sep ranks (the tower's parameters fetched on every rank, a rank with no piece too). Then
the refusals of bad inputs and plans, each recorded with its message.
"""
import sys

import ernie_vl
import numpy as np
import paddle
from amp_emulation import emulated
import paddle.distributed as dist
from report import mean_over_ranks, run, train
from vl_models import batch_of, build

import paddle_cp as pcp
from paddle_cp import runtime
from paddle_cp.attention import resolve_group
from paddle_cp.attention.dispatch import batch as batch_context
from paddle_cp.plans import vision_split

STEPS = 3
VISION_TOWERS = {"paddleocr_vl": "visual"}  # the others: model.visual
LANGUAGE_MODELS = {"paddleocr_vl": "model", "ernie4_5_vl": "model"}  # the others: model.language_model


def adamw(model):
    return paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-3, parameters=model.parameters())


def plan_for(family, backend, degree, key="", split=False):
    """The plan users write; `key`: where PrepareContextParallel goes ("" the top, "inner", "language"); `split`:
    the vision tower split by images too."""
    language = LANGUAGE_MODELS.get(family, "model.language_model")
    where = {"": "", "inner": "model", "language": language}[key]
    plan = {where: pcp.PrepareContextParallel(backend, degree),
            f"{language}.layers.*.self_attn": pcp.ContextParallel(backend, degree)}
    if split:
        plan[VISION_TOWERS.get(family, "model.visual")] = pcp.ContextParallel(backend, degree)
    return plan


def built(family, frozen=False):
    """The family's tiny model; `frozen`: its vision tower not trained (no gradient), as a user freezing it."""
    paddle.seed(2024)
    model = build(family)
    if frozen:
        for param in model.get_sublayer(VISION_TOWERS.get(family, "model.visual")).parameters():
            param.stop_gradient = True
    return model


def reference(family, kind, world, frozen=False):
    model = built(family, frozen)
    batch = batch_of(family, kind, model, world)
    logits = []

    def steps():
        for _ in range(STEPS):
            out = model(**batch, return_dict=True)
            logits.append(out.logits.detach())
            yield out.loss

    return train(model, adamw(model), steps()), logits[0]


def parallel(family, kind, mesh, backend, degree, key="", split=False, frozen=False, sharding_level=None):
    model = built(family, frozen)
    batch = batch_of(family, kind, model, mesh.shape[0])
    plan = plan_for(family, backend, degree, key, split)
    config = {"cp_config": {"parallelize_plan": plan}}
    if sharding_level is not None:
        config["dp_config"] = {"sharding_level": sharding_level}
    model, opt = pcp.parallelize(model, adamw(model), mesh, config)
    prepare = next(p for p in plan.values() if isinstance(p, pcp.PrepareContextParallel))
    documents = {"attn_mask_startend_row_indices": batch.get("attn_mask_startend_row_indices")}
    logits, local, labelled = [], [], []

    def steps():
        for _ in range(STEPS):
            if key:  # Paddle's spelling: the labels split before the forward
                inputs = {**batch, "labels": pcp.shard_sequence(batch["labels"], backend=prepare, mesh=mesh,
                                                                **documents)}
            else:  # the model gets the whole batch; this rank's labels follow its forward's layout
                inputs = batch
            out = model(**inputs, return_dict=True)
            logits.append(out.logits)
            labels = pcp.shard_sequence(batch["labels"], backend=prepare, mesh=mesh, **documents)
            local.append(labels.shape[1])
            labelled.append(int((labels != -100).sum()))
            yield out.loss * pcp.loss_weight(int((labels != -100).sum()), mesh)

    pcp.reset_counters()
    losses, grads, params = train(model, opt, steps())
    if sharding_level == 3:  # this rank holds a shard of each: the whole parameters gathered, no gradients
        whole_params = pcp.full_state_dict(model)
        params, grads = {name: whole_params[name] for name in params}, None
    sent = pcp.bytes_sent()
    whole = pcp.unshard_sequence(logits[0].detach(), backend=prepare, mesh=mesh, **documents)
    facts = {"tokens": local[0], "labelled": labelled[0], "bytes_sent": sum(sent.values()),
             "uneven_buckets": sum(bucket.uneven for bucket in opt.gradient_buckets.buckets)}
    if "token_type_ids" in batch:  # ERNIE-VL: [b, s + 1], each token's type first
        own = pcp.shard_sequence(batch["token_type_ids"][:, :-1], backend=prepare, mesh=mesh)
        facts["text_only"] = not bool(own.any())  # its decoder layers route as one card's all the same
    if split:
        facts.update(vision_facts(model, mesh), vision_sent=sent.get(vision_split.TAG, 0))
    return (mean_over_ranks(losses, mesh), grads, params), whole, facts


def vision_facts(model, mesh):
    """What the last forward's vision split did on this rank: the pieces it ran of all, the features it computed
    of all, and the bytes its exchanges send in STEPS steps by the layout (the features its tokens' owners lack,
    forward, and the gradients of those it received, backward, unless the tower is frozen)."""
    vision = batch_context.last_split(resolve_group(mesh)).vision
    tower = next(layer for layer in model.sublayers() if layer in runtime.installed.vision_splits)
    split = runtime.installed.vision_splits[tower]
    trained = tower.parameters() + (split.merger.parameters() if split.merger is not None else [])
    row_bytes = vision_split.feature_row_bytes(split.widths, vision.dtype)
    backward = not all(param.stop_gradient for param in trained)
    facts = {"pieces": [0, 0], "features": [0, 0], "vision_expected": 0}
    for kind, pieces in vision.pieces.items():
        computed, destination = vision.feature_ranks(kind), vision.destinations(kind)
        here = vision.index
        facts["pieces"] = [facts["pieces"][0] + int((vision.rank[kind] == here).sum()),
                           facts["pieces"][1] + len(pieces.grids)]
        facts["features"] = [facts["features"][0] + int((computed == here).sum()), facts["features"][1] + len(computed)]
        rows = int(((computed == here) & (destination != here)).sum()
                   + backward * ((destination == here) & (computed != here)).sum())
        facts["vision_expected"] += STEPS * rows * row_bytes
    return facts


def with_one_placeholder_less(family, kind, mesh, placeholder):
    """(the family's model parallelized with the plan users write, a batch of `kind`, its input ids with one
    `placeholder` replaced by a text token)."""
    paddle.seed(0)
    model = build(family)
    batch = batch_of(family, kind, model, mesh.shape[0])
    pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan_for(family, "p2p", None)}})
    ids = batch["input_ids"].numpy().copy()
    ids[0, list(ids[0]).index(placeholder)] = 5
    return model, batch, ids


def forwards_refused(report, model, bad):
    """Each forward on the bad inputs `bad[name]` (copies: ERNIE-VL's forward rewrites its token types in place):
    its error, and the collectives that had sent bytes by then."""
    for name, inputs in bad.items():
        pcp.reset_counters()
        report.expect_error(name, lambda: model(**{key: value.clone() for key, value in inputs.items()}))
        report.value(f"{name}.sent", sorted(tag for tag, sent in pcp.bytes_sent().items() if sent))


def refusals(report, mesh):
    """Bad inputs and plans: a clear error on every rank before any collective."""
    family = "qwen2_5_vl"
    model, batch, one_less = with_one_placeholder_less(family, "images", mesh, 120)
    bad = {
        "too_few_image_tokens": {**batch, "input_ids": paddle.to_tensor(one_less)},
        "grids_disagree_with_pixels": {**batch, "pixel_values": batch["pixel_values"][:-4]},
        "pixels_without_grids": {key: v for key, v in batch.items() if key != "image_grid_thw"},
        "rope_indices_transposed": {**batch, "position_ids": model.model.get_rope_index(
            batch["input_ids"], batch["image_grid_thw"])[0].transpose([1, 0, 2])},  # [b, 3, s]
    }
    forwards_refused(report, model, bad)
    unrouted = build(family)
    report.expect_error("vision_only_plan", lambda: pcp.parallelize(unrouted, None, mesh, {"cp_config": {
        "parallelize_plan": {"": pcp.PrepareContextParallel("p2p")}}}))

    class UnknownVL(paddle.nn.Layer):  # a VL model of a family paddle_cp has no rule for
        def __init__(self):
            super().__init__()
            self.embed = paddle.nn.Embedding(16, 8)

        def forward(self, input_ids, pixel_values=None, labels=None):
            return self.embed(input_ids)

    report.expect_error("tower_without_merge", lambda: pcp.parallelize(build(family), None, mesh, {"cp_config": {
        "parallelize_plan": plan_for(family, "p2p", None, key="language", split=True)}}))
    report.expect_error("unknown_family", lambda: pcp.parallelize(UnknownVL(), None, mesh, {"cp_config": {
        "parallelize_plan": {"": pcp.PrepareContextParallel("p2p")}}}))


def ernie_refusals(report, mesh):
    """ERNIE-VL's own: packed documents its top model would drop, PrepareContextParallel keyed on its decoder
    (its head reads label types the top makes from the whole batch), placeholders for a video's merged frames, a
    second head for image special tokens (a loss of its own)."""
    family = "ernie4_5_vl"
    model, batch, one_less = with_one_placeholder_less(family, "video", mesh, ernie_vl.IM_PATCH)
    ids = batch["input_ids"].numpy()
    length = ids.shape[1]
    bad = {
        "ernie_documents_dropped": {**batch, "attn_mask_startend_row_indices": paddle.full([1, 1, length], length,
                                                                                            "int32")},
        "ernie_too_few_video_tokens": {**batch, "input_ids": paddle.to_tensor(one_less)},
    }
    forwards_refused(report, model, bad)
    report.expect_error("ernie_keyed_on_decoder", lambda: pcp.parallelize(build(family), None, mesh, {"cp_config": {
        "parallelize_plan": plan_for(family, "p2p", None, key="language")}}))
    report.expect_error("ernie_second_head", lambda: pcp.parallelize(build(family, mm_vocab_size=8), None, mesh, {
        "cp_config": {"parallelize_plan": plan_for(family, "p2p", None)}}))
    plan = {**plan_for(family, "p2p", None), "vision_model": pcp.ContextParallel("p2p")}  # no VisionTower rule
    report.expect_error("ernie_vision_split", lambda: pcp.parallelize(build(family), None, mesh, {
        "cp_config": {"parallelize_plan": plan}}))


def amp_run(family, kind, mesh, amp):
    """(losses, {name: fp32 weight}, {name: initial weight}) of STEPS AdamW steps of `family` in fp32 or (`amp`) in
    the CPU emulation of bf16 O2 with fp32 master gradients (decorated after parallelize, as users do); over
    `mesh` with the vision tower split (None: one card); weights are the fp32 master weights of a bf16 run."""
    model = built(family)
    batch = batch_of(family, kind, model, mesh.shape[0] if mesh is not None else 2)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-3, parameters=model.parameters(),
                                 multi_precision=amp)
    initial = {n: p.numpy().copy() for n, p in model.named_parameters()}
    if mesh is not None:
        plan = plan_for(family, "p2p", None, split=True)
        model, opt = pcp.parallelize(model, opt, mesh, {"cp_config": {"parallelize_plan": plan}})
    if amp:
        model, opt = paddle.amp.decorate(models=model, optimizers=opt, level="O2", dtype="bfloat16",
                                         master_grad=True)
    losses = []
    for _ in range(STEPS):
        with paddle.amp.auto_cast(enable=amp, level="O2", dtype="bfloat16"):
            out = model(**batch, return_dict=True)
        loss = out.loss.astype("float32")
        if mesh is not None:
            labels = pcp.shard_sequence(batch["labels"], backend=plan[""], mesh=mesh)
            loss = loss * pcp.loss_weight(int((labels != -100).sum()), mesh)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss)
    losses = mean_over_ranks(losses, mesh) if mesh is not None else [float(x) for x in losses]
    masters = opt._master_weights if amp else {}
    weights = {n: (masters[p.name] if p.name in masters else p.astype("float32")).numpy()
               for n, p in model.named_parameters()}
    return np.array(losses), weights, initial


def bf16_distances(report, mesh):
    """Qwen2.5-VL with its vision tower split, in the bf16 O2 emulation on the sep ranks and on one card, each set
    beside an fp32 one-card run: the losses' largest difference, the final weights' relative to the fp32 update."""
    family, kind = "qwen2_5_vl", "video"
    truth = amp_run(family, kind, None, amp=False)
    with emulated(True):
        runs = {"one_card": amp_run(family, kind, None, amp=True), "paddle_cp": amp_run(family, kind, mesh, amp=True)}
    update = {k: truth[1][k] - truth[2][k] for k in truth[1]}
    for who, (losses, weights, _) in runs.items():
        moved = sum(float(np.sum((weights[k].astype(np.float64) - truth[1][k]) ** 2)) for k in update)
        report.value(f"bf16.{who}", {"loss": float(np.abs(losses - truth[0]).max()),
                                     "weights": float(np.sqrt(moved / sum(float(np.sum(u ** 2)) for u in update.values())))})
    report.value("bf16.loss_half_ulp", 2.0 ** -9 * float(np.max(truth[0])))


def main(report):
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["sep"])
    for spec in sys.argv[1:]:
        family, backend, *rest = spec.split(":")
        degree = next((int(x) for x in rest if x.isdigit()), None)
        key = next((x for x in rest if x in ("inner", "language")), "")
        kind = rest[-1]
        frozen = "frozen" in rest
        want, want_logits = reference(family, kind, mesh.shape[0], frozen)
        level = next((int(x[1:]) for x in rest if x in ("l1", "l2", "l3")), None)
        got, got_logits, facts = parallel(family, kind, mesh, backend, degree, key, "split" in rest, frozen, level)
        report.training(spec, got, want if got[1] is not None else (want[0], {}, want[2]))
        report.diff(f"{spec}.logits", got_logits, want_logits)
        if got[1] is not None:
            report.value(f"{spec}.grads_compared", len(set(got[1]) & set(want[1])))
        report.value(f"{spec}.params", len(want[1]))
        facts["tokens"] = [facts["tokens"], want_logits.shape[1]]
        for name, value in facts.items():  # labelled: this rank's labelled tokens (0: its loss layer gives a zero)
            report.value(f"{spec}.{name}", value)
    report.value("runs", sys.argv[1:])
    bf16_distances(report, mesh)
    refusals(report, mesh)
    ernie_refusals(report, mesh)


if __name__ == "__main__":
    run(main)
