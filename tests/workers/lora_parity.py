"""PaddleFormers' own LoRAModel on a PaddleFormers Llama (tiny config, eager attention) trained 3 AdamW
steps under parallelize vs one card with the same LoRA model; then checkpoints and export_pretrained.

argv: the directory for the merged export, then the runs, each a mesh ("mp4", "sep4", "dp4", "dp2xmp2",
"mp2xsep2", "pp2xmp2"; dims joined by "x"; pp: 2 micro-batches) with
options ":gather" (Paddle's LoRA plan exactly as its test writes it: q/k/v gather their output, o_proj
splits its input), ":sp" (Paddle's sequence-parallel plan, which names no LoRA factor) and ":l<level>" (dp sharding level).
mp uses Paddle's LoRA plan keys (a plan on lora_B of every ColWise projection, on lora_A of every
RowWise one), sep the ring. The optimizer holds every parameter, frozen ones too; the sequence (8N+4
tokens) does not divide into the 2 x sep chunks of the sep4 ring. The first run also saves a
checkpoint, which the second loads (another mesh) and every rank loads into an unparallelized LoRA
model; the last run exports.
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddleformers_models import build
from report import run

import paddle_cp as pcp
from paddle_cp.comm import collectives
from paddle_cp.params import record_of

STEPS, BATCH = 3, 4
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
COLUMN, ROW = PROJECTIONS[:3] + PROJECTIONS[4:6], (PROJECTIONS[3], PROJECTIONS[6])
LAYERS = "model.model.layers.*."  # LoRAModel keeps the model as .model: Paddle's test's `prefix = "model."`


def lora_model():
    from paddleformers.peft import LoRAConfig, LoRAModel

    paddle.seed(2024)
    model = build("llama", num_key_value_heads=4)  # 4 k/v heads: mp4 divides them
    config = LoRAConfig(target_modules=[f".*{proj}" for proj in PROJECTIONS], r=8, lora_alpha=16)
    return LoRAModel(model, config)


CLIP = 0.05  # below the LoRA gradients' global norm: every step is clipped, by the norm over all shards


def adamw(model):
    return paddle.optimizer.AdamW(learning_rate=1e-2, epsilon=1e-3, parameters=model.parameters(),
                                  grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP))


def lora_plan(gather):
    """Paddle's LoRA plan (test_parallel_api_with_llama_lora), written with paddle_cp's plan classes."""
    plan = {"model.model.embed_tokens": pcp.ColWiseParallel(gather_output=True),
            "model.lm_head.weight": pcp.ColWiseParallel()}
    for proj in COLUMN:
        plan[LAYERS + proj] = pcp.ColWiseParallel(gather_output=gather and proj.startswith("self_attn"))
        plan[LAYERS + proj + ".lora_B"] = pcp.ColWiseParallel()
    for proj in ROW:
        plan[LAYERS + proj] = pcp.RowWiseParallel(is_input_parallel=not (gather and proj.startswith("self_attn")))
        plan[LAYERS + proj + ".lora_A"] = pcp.RowWiseParallel()
    return plan


def sequence_parallel_plan():
    """Paddle's sequence-parallel plan from the same test: with test_lora it names no LoRA factor."""
    model = "model.model."
    return {
        model + "embed_tokens": [pcp.ColWiseParallel(), pcp.SequenceParallelBegin()],
        **{LAYERS + proj: pcp.ColWiseParallel() for proj in COLUMN},
        **{LAYERS + proj: pcp.RowWiseParallel() for proj in ROW},
        LAYERS + "self_attn": pcp.SequenceParallelDisable(),
        LAYERS + "mlp": pcp.SequenceParallelDisable(need_transpose=False),
        "model.lm_head.weight": pcp.ColWiseParallel(),
        "model.lm_head": pcp.SequenceParallelEnd(),
    }


CP_PLAN = {"model.model": pcp.PrepareContextParallel("p2p"),
           "model.model.layers.*.self_attn": pcp.ContextParallel("p2p")}


def batches(seq):
    rng = np.random.RandomState(7)
    for _ in range(STEPS):
        ids = rng.randint(0, 128, [BATCH, seq + 1])
        yield paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:])


def trainable(model):
    return {n: p for n, p in model.named_parameters() if not p.stop_gradient}


def full_gradient(param):
    shards = record_of(param).shards()
    if not shards:
        return param.grad.numpy()
    return shards[0].assemble([g.numpy() for g in collectives.all_gather(shards[0].group, param.grad, tag="test")])


def train(model, optimizer, seq, mesh=None, sep=False):
    """Losses (global token mean per step), last step's reduced LoRA gradients; one card: the gradient norms."""
    losses, grads, norms = [], {}, []
    for step, (ids, labels) in enumerate(batches(seq)):
        weight = 1.0
        if mesh is not None:
            ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
            if sep:
                labels = pcp.shard_sequence(labels, mesh=mesh)
            weight = pcp.loss_weight(int((labels != -100).sum()), mesh)
        loss = model(input_ids=ids, labels=labels)[0] * weight
        loss.backward()
        if mesh is None:
            norms.append(float(paddle.sqrt(sum(paddle.sum(p.grad ** 2) for p in trainable(model).values()))))
        optimizer.step()  # reduces (and clips) the gradients in place: compared after it
        if step == STEPS - 1:  # a rank keeps the gradients it owns (sharding) of the parameters it holds (pp)
            grads = {n: full_gradient(p) for n, p in trainable(model).items()
                     if record_of(p).steps_here()}
        optimizer.clear_grad()
        total = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(total)  # mp copies are equal: the world mean is the dp x sep mean
            total = total / dist.get_world_size()
        losses.append(float(total))
    return np.array(losses), grads, norms


def one_card(seq):
    model = lora_model()
    initial = {k: v.numpy() for k, v in model.state_dict().items()}
    losses, grads, norms = train(model, adamw(model), seq)
    assert min(norms) > CLIP, f"gradient norms {norms} should exceed the clip norm {CLIP}"
    return model, initial, losses, grads, {k: v.numpy() for k, v in model.state_dict().items()}


def mesh_of(spec):
    dims = [(part.rstrip("0123456789"), int(part.lstrip("abcdefghijklmnopqrstuvwxyz"))) for part in spec.split("x")]
    shape = [size for _, size in dims]
    return dist.ProcessMesh(np.arange(dist.get_world_size()).reshape(shape).tolist(), dim_names=[n for n, _ in dims])


def parallel(spec):
    mesh_spec, *options = spec.split(":")
    mesh = mesh_of(mesh_spec)
    model = lora_model()
    optimizer = adamw(model)
    level = next((int(o[1:]) for o in options if o.startswith("l")), 0)
    config = {"dp_config": {"sharding_level": level}}
    if "mp" in mesh.dim_names:
        plan = sequence_parallel_plan() if "sp" in options else lora_plan("gather" in options)
        config["mp_config"] = {"parallelize_plan": plan}
    if "sep" in mesh.dim_names:
        config["cp_config"] = {"parallelize_plan": CP_PLAN}
    if "pp" in mesh.dim_names:
        config["pp_config"] = {"split_spec": "model.model.layers", "global_spec": "model.model.rotary_emb",
                               "accumulate_steps": 2}
    model, optimizer = pcp.parallelize(model, optimizer, mesh, config)
    return model, optimizer, mesh


def check_training(report, spec, reference, seq):
    _, initial, ref_losses, ref_grads, ref_state = reference
    model, optimizer, mesh = parallel(spec)
    shapes = {n: list(p.shape) for n, p in trainable(model).items() if "layers.0.self_attn" in n}
    losses, grads, _ = train(model, optimizer, seq, mesh, "sep" in mesh.dim_names)
    report.value(f"{spec}.losses", losses.tolist())
    report.value(f"{spec}.local_shapes", shapes)
    report.diff(f"{spec}.loss", losses, ref_losses)
    report.value(f"{spec}.trainable", sorted(trainable(model)))
    report.value(f"{spec}.grads_compared", len(grads))
    for name, grad in grads.items():
        report.diff(f"{spec}.grad", grad, ref_grads[name])
    state = pcp.full_state_dict(model)
    for name, value in ref_state.items():
        kind = "param" if "lora" in name else "frozen"
        report.diff(f"{spec}.{kind}", state[name], value)
        if kind == "frozen":
            report.diff(f"{spec}.frozen_moved", state[name], initial[name])
    return model, optimizer


def check_checkpoint(report, saved, spec, reference, root):
    """A checkpoint saved on `saved`'s mesh, loaded on `spec`'s and into an unparallelized model."""
    model, optimizer, _ = parallel(spec)
    pcp.load_checkpoint(root, model, optimizer)
    ref_state = reference[4]
    state = pcp.full_state_dict(model)
    for name, value in ref_state.items():
        report.diff(f"checkpoint.{saved}->{spec}", state[name], value)
    plain = lora_model()
    pcp.load_checkpoint(root, plain)
    for name, value in plain.state_dict().items():
        report.diff(f"checkpoint.{saved}->one_process", value, ref_state[name])


def check_export(report, model, reference, directory):
    """export_pretrained writes what LoRAModel.save_pretrained writes on one card; from_pretrained reads it."""
    from paddleformers.peft import LoRAModel

    pcp.export_pretrained(model, directory)
    report.value("export.files", sorted(os.listdir(directory)))
    one_card_model = reference[0]
    loaded = LoRAModel.from_pretrained(build("llama", num_key_value_heads=4), directory)
    report.value("export.keys_match", sorted(loaded.get_trainable_state_dict()) ==
                 sorted(one_card_model.get_trainable_state_dict()))
    for name, value in one_card_model.get_trainable_state_dict().items():
        report.diff("export.lora", loaded.get_trainable_state_dict()[name], value)
    saved = paddle.load(os.path.join(directory, "lora_model_state.pdparams"), return_numpy=True)
    report.value("export.saved_keys", sorted(saved))


def check_merged_export(report, model, one_card_model, directory):
    """merge_lora=True: the files hold W + lora_A @ lora_B * scaling of one card's trained model; the pytest
    side loads them with LlamaForCausalLM.from_pretrained (one process) and compares with `expected.npz`."""
    pcp.export_pretrained(model, directory, merge_lora=True)
    want = {name: value.numpy() for name, value in one_card_model.model.state_dict().items()}
    for name, layer in one_card_model.model.named_sublayers():
        if hasattr(layer, "lora_A"):
            want[f"{name}.weight"] = want[f"{name}.weight"] + want.pop(f"{name}.lora_A") @ want.pop(
                f"{name}.lora_B") * layer.scaling
    if dist.get_rank() == 0:
        np.savez(os.path.join(directory, "expected.npz"), **want)


def main(report):
    seq = 8 * dist.get_world_size() + 4  # sequence parallelism needs mp to divide it; the sep4 ring splits it unevenly
    reference = one_card(seq)
    report.value("one_card.losses", reference[2].tolist())
    merged_directory, *specs = sys.argv[1:]
    root = os.path.join(os.environ["PCP_REPORT_DIR"], "lora_checkpoint")
    model = None
    for i, spec in enumerate(specs):
        model, optimizer = check_training(report, spec, reference, seq)
        if i == 0:
            pcp.save_checkpoint(root, model, optimizer)
    check_checkpoint(report, specs[0], specs[1], reference, root)
    check_export(report, model, reference, os.path.join(os.environ["PCP_REPORT_DIR"], "lora_export"))
    check_merged_export(report, model, reference[0], merged_directory)
    report.value("runs", specs)


if __name__ == "__main__":
    run(main)
