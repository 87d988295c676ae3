"""Pretrained weights, export and checkpoints on 4 ranks, each rank within its share.

argv: root, holding the directories save_pretrained wrote (made by the test):
  llama_one (one file + index), llama_unified (model.safetensors, no index), phi3_sharded (many files).
On each layout, dp2xmp2_l3 (PaddleFormers' tensor-parallel plan, sharding level 3) and pp2xsep2_l3
(2 stages, ring attention, sharding level 3 over the context-parallel ranks), for each directory: a model built from another seed is parallelized, load_pretrained fills it; each
rank's slices must equal ModelClass.from_pretrained(directory) on one card (computed by the test), then one
AdamW step must give one card's loss and state. Then export_pretrained, save_checkpoint and
load_checkpoint (sync and async). Every phase reports its peak, share and bytes (tools/memory/io_phases.py).
"""
import contextlib
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
from report import run
from tensor_parallel import fused_plan, paddle_plan

import paddle_cp as pcp
from paddle_cp.checkpoint import layout
from paddle_cp.comm import collectives
from paddle_cp import mesh as mesh_lib
from paddle_cp.tools.memory.io_phases import measure

BATCH, SEQ, EPSILON = 4, 16, 1e-3
SIZES = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, fuse_rms_norm=False)
CASES = {"llama_one": "llama", "llama_unified": "llama", "phi3_sharded": "phi3"}
LAZY = {("dp2xmp2_l3", "llama_unified"), ("pp2xsep2_l3", "llama_one")}  # built under paddle.LazyGuard()


def model_class(family):
    import paddleformers.transformers as pf

    return {"llama": pf.LlamaForCausalLM, "phi3": pf.Phi3ForCausalLM}[family]


def config_of(family):
    import paddleformers.transformers as pf

    return {"llama": pf.LlamaConfig, "phi3": pf.Phi3Config}[family](**SIZES)


def optimizer_of(model):
    return paddle.optimizer.AdamW(learning_rate=1e-2, epsilon=EPSILON, parameters=model.parameters())


def batch():
    rng = np.random.RandomState(3)
    return (paddle.to_tensor(rng.randint(0, SIZES["vocab_size"], [BATCH, SEQ]), dtype="int64"),
            paddle.to_tensor(rng.randint(0, SIZES["vocab_size"], [BATCH, SEQ]), dtype="int64"))


def one_card(family, directory):
    """from_pretrained on one card (in the test's own process: in a launched rank it takes Paddle's
    distributed loader, which needs a GPU): its values, and one step's loss and state."""
    model = model_class(family).from_pretrained(directory)
    loaded = {k: v.numpy() for k, v in model.state_dict().items()}
    optimizer = optimizer_of(model)
    ids, labels = batch()
    loss = model(input_ids=ids, labels=labels)[0]
    loss.backward()
    optimizer.step()
    return loaded, float(loss), {k: v.numpy() for k, v in model.state_dict().items()}


def save_reference(root, directory_name):
    loaded, loss, state = one_card(CASES[directory_name], os.path.join(root, directory_name))
    np.savez(os.path.join(root, f"{directory_name}.reference.npz"), loss=loss,
             **{f"loaded/{k}": v for k, v in loaded.items()}, **{f"state/{k}": v for k, v in state.items()})


def load_reference(root, directory_name):
    saved = np.load(os.path.join(root, f"{directory_name}.reference.npz"))
    part = {kind: {k.split("/", 1)[1]: saved[k] for k in saved.files if k.startswith(kind + "/")}
            for kind in ("loaded", "state")}
    return part["loaded"], float(saved["loss"]), part["state"]


def mesh_and_config(layout_name, family, model):
    if layout_name == "dp2xmp2_l3":
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        plan = fused_plan() if family == "phi3" else paddle_plan(model)
        return mesh, {"mp_config": {"parallelize_plan": plan}, "dp_config": {"sharding_level": 3}}
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "sep"])
    return mesh, {"cp_config": {"parallelize_plan": {"": pcp.PrepareContextParallel("p2p"),
                                                     "model.layers.*.self_attn": pcp.ContextParallel("p2p")}},
                  "pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary_emb",
                                "accumulate_steps": 2},
                  "dp_config": {"sharding_level": 3}}


def step(model, optimizer, mesh):
    """One step on the global batch; the global loss (mean over the dp x sep replicas)."""
    ids, labels = batch()
    if "dp" in mesh.dim_names:
        ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
    loss = model(input_ids=ids, labels=labels)[0]
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()
    group = mesh_lib.mesh_group(mesh, ["dp", "sep"])
    total = collectives.all_reduce(group, paddle.to_tensor([float(loss)], dtype="float32"))
    return float(total.numpy()[0]) / group.size


def compare_local(report, name, model, want):
    """Each value this rank holds against its slices of the one-card values."""
    for key, tensor in model.state_dict().items():
        if layout.holds_value(tensor):
            cut = layout.local_value(tensor, lambda offset, shape: want[key][
                tuple(slice(o, o + n) for o, n in zip(offset, shape))])
            report.diff(f"{name}.local", tensor, cut)


def phases(report, name, rows):
    for row in rows:
        report.value(f"{name}.{row['phase']}", row)


def case(report, layout_name, root, directory_name):
    family = CASES[directory_name]
    directory = os.path.join(root, directory_name)
    loaded, want_loss, want_state = load_reference(root, directory_name)
    paddle.seed(123)  # other values than the files': only loading can make them agree
    lazy = (layout_name, directory_name) in LAZY
    with paddle.LazyGuard() if lazy else contextlib.nullcontext():  # the fine-tuning recipe: no values yet
        model = model_class(family)(config_of(family))
    mesh, config = mesh_and_config(layout_name, family, model)
    model, optimizer = pcp.parallelize(model, optimizer_of(model), mesh, config)
    name = f"{layout_name}.{directory_name}"
    rows = [dict(measure("load_pretrained", lambda: pcp.load_pretrained(model, directory), model), lazy=lazy)]
    compare_local(report, name, model, loaded)
    report.diff(f"{name}.loss", np.array([step(model, optimizer, mesh)]), np.array([want_loss]))
    compare_local(report, f"{name}.after_step", model, want_state)
    if directory_name != "phi3_sharded":
        return rows
    export = os.path.join(root, f"export_{layout_name}")
    rows.append(measure("export", lambda: pcp.export_pretrained(model, export, max_shard_size="300KB"), model))
    report.value(f"{name}.export_files", sorted(os.listdir(export)))  # the test loads it with from_pretrained
    checkpoint = os.path.join(root, f"checkpoint_{layout_name}")
    rows.append(measure("save", lambda: pcp.save_checkpoint(checkpoint, model, optimizer), model, optimizer))
    for p in model.parameters():  # only loading can bring the trained values back
        if p._is_initialized() and p.numel() > 0:
            p.set_value(paddle.zeros_like(p))
    rows.append(measure("load", lambda: pcp.load_checkpoint(checkpoint, model, optimizer), model, optimizer))
    compare_local(report, f"{name}.checkpoint", model, want_state)
    report.value(f"{name}.async_step_seconds", async_step(model, optimizer, mesh, root, layout_name))
    return rows


def async_step(model, optimizer, mesh, root, layout_name):
    """Seconds of a step without a save, of the async save's call, and of the step right after it."""
    dist.barrier()
    start = time.perf_counter()
    step(model, optimizer, mesh)
    plain = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    pcp.save_checkpoint(os.path.join(root, f"async_{layout_name}"), model, optimizer, async_save=True)
    call = time.perf_counter() - start
    start = time.perf_counter()
    step(model, optimizer, mesh)
    after = time.perf_counter() - start
    pcp.wait_checkpoint()
    return {"plain_step": plain, "async_save_call": call, "step_after_async_save": after}


def bad_inputs(report, root):
    """load_pretrained's checks: the same ValueError on every rank, before any data moves."""
    pcp.set_mesh(dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]))
    other = dict(SIZES, hidden_size=128)
    import paddleformers.transformers as pf

    cases = {
        "no_directory": (lambda: pf.LlamaForCausalLM(pf.LlamaConfig(**SIZES)), "nowhere"),
        "index_lists_missing_file": (lambda: pf.Phi3ForCausalLM(pf.Phi3Config(**SIZES)), "phi3_missing_file"),
        "no_weights": (lambda: pf.LlamaForCausalLM(pf.LlamaConfig(**SIZES)), "empty"),
        "other_shapes": (lambda: pf.LlamaForCausalLM(pf.LlamaConfig(**other)), "llama_one"),
        "fewer_layers": (lambda: pf.LlamaForCausalLM(pf.LlamaConfig(**dict(SIZES, num_hidden_layers=1))),
                         "llama_one"),
        "more_layers": (lambda: pf.LlamaForCausalLM(pf.LlamaConfig(**dict(SIZES, num_hidden_layers=3))),
                        "llama_one"),
        "other_dtype": (lambda: pf.LlamaForCausalLM(pf.LlamaConfig(**SIZES)).to(dtype="float16"), "llama_one"),
    }
    for name, (make, directory) in cases.items():
        model = make()
        report.expect_error(f"pretrained_{name}", lambda: pcp.load_pretrained(model, os.path.join(root, directory)))
    report.expect_error("pretrained_not_a_layer", lambda: pcp.load_pretrained({}, root))
    report.expect_error("export_shard_size", lambda: pcp.export_pretrained(
        pf.LlamaForCausalLM(pf.LlamaConfig(**SIZES)), os.path.join(root, "x"), max_shard_size="big"))
    # no case left a rank inside a collective
    report.value("ranks_after_bad_inputs", int(collectives.all_reduce(
        mesh_lib.mesh_group(pcp.get_mesh(), ["dp", "mp"]), paddle.to_tensor([1], dtype="int32")).numpy()[0]))


def main(report):
    paddle.set_device("cpu")
    dist.init_parallel_env()
    root = sys.argv[1]
    for layout_name, names in (("dp2xmp2_l3", CASES), ("pp2xsep2_l3", ("llama_one", "phi3_sharded"))):
        rows = []
        for directory_name in names:
            rows += [dict(row, case=directory_name) for row in case(report, layout_name, root, directory_name)]
        report.value(f"{layout_name}.phases", rows)
    bad_inputs(report, root)


if __name__ == "__main__":
    run(main)
