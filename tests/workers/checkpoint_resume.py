"""Train PaddleFormers Llama on one layout, save, resume on another, compare with one card.

argv: layout root load_from steps save_to [async] [export]
  layout: a key of LAYOUTS; load_from / save_to: checkpoint names under root ("-": none);
  steps: how many steps to run after loading (the step index comes from the checkpoint's extra);
  async: save with async_save=True; export: pcp.export_pretrained to root/export at the end.
Each step's global loss and the full state after it are compared with one uninterrupted card
(tensor_parallel.py's model, AdamW epsilon 1e-3, two parameter groups, global-norm clip).
After a load, the same checkpoint is also resumed in one process with no parallelism.
"""
import os
import sys

import numpy as np
import paddle.distributed as dist
from report import run
from tensor_parallel import CP_PLAN, DP2_MP2, WELL_CONDITIONED_EPSILON, batches, build, paddle_plan

import paddle_cp as pcp

MODEL = "llama"
LAYOUTS = {
    "dp2xmp2_l3": dict(dims=DP2_MP2, mp=True, level=3),
    "dp2xmp2_l1": dict(dims=DP2_MP2, mp=True, level=1),
    "sep2": dict(dims=[("sep", 2)], cp=True),
    "sep2_l3": dict(dims=[("sep", 2)], cp=True, level=3),  # sharded over the context-parallel ranks
    "pp2": dict(dims=[("pp", 2)], pp=True),
}
PP_CONFIG = {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "schedule_mode": "1F1B",
             "accumulate_steps": 2}


def reference():
    """Per step: the global loss and the state after it, on one card."""
    model, optimizer = build(MODEL, WELL_CONDITIONED_EPSILON)
    losses, states = [], []
    for ids, labels in batches(MODEL):
        loss = model(input_ids=ids, labels=labels)[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
        states.append({k: v.numpy() for k, v in model.state_dict().items()})
    return losses, states


def model_to_resume():
    """The reference's model with other weights: only a checkpoint can make them agree again."""
    model, optimizer = build(MODEL, WELL_CONDITIONED_EPSILON)
    for p in model.parameters():
        p.set_value(p * 0.5 + 0.01)
    return model, optimizer


def parallel_model(resuming, dims, mp=False, cp=False, level=0, pp=False):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(np.arange(world).reshape([d for _, d in dims]).tolist(), dim_names=[n for n, _ in dims])
    model, optimizer = model_to_resume() if resuming else build(MODEL, WELL_CONDITIONED_EPSILON)
    config = {"dp_config": {"sharding_level": level}}
    if mp:
        config["mp_config"] = {"parallelize_plan": paddle_plan(model)}
    if cp:
        config["cp_config"] = {"parallelize_plan": CP_PLAN}
    if pp:
        config["pp_config"] = PP_CONFIG
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config=config)
    return model, optimizer, mesh, cp


def parallel_step(model, optimizer, mesh, cp, ids, labels):
    ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
    if cp:
        labels = pcp.shard_sequence(labels, mesh=mesh)
    loss = model(input_ids=ids, labels=labels)[0]
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # mp copies are equal: the world mean is the dp x sep mean
    return float(total) / dist.get_world_size()


def compare(report, name, loss, state, want_loss, want_state):
    report.diff(f"{name}.loss", np.array([loss]), np.array([want_loss]))
    report.value(f"{name}.keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.state", state.get(key, np.zeros([0])), value)


def resume_in_one_process(report, path, want_losses, want_states):
    """The checkpoint loaded into a plain model and optimizer (no parallelize), one more step."""
    model, optimizer = model_to_resume()
    step = pcp.load_checkpoint(path, model, optimizer)["step"]
    ids, labels = list(batches(MODEL))[step]
    loss = model(input_ids=ids, labels=labels)[0]
    loss.backward()
    optimizer.step()
    compare(report, f"one_process.step{step}", float(loss), {k: v.numpy() for k, v in model.state_dict().items()},
            want_losses[step], want_states[step])


def main(report):
    layout, root, load_from, steps, save_to = sys.argv[1:6]
    async_save, export = "async" in sys.argv[6:], "export" in sys.argv[6:]
    want_losses, want_states = reference()
    model, optimizer, mesh, cp = parallel_model(load_from != "-", **LAYOUTS[layout])
    step = 0
    if load_from != "-":
        step = pcp.load_checkpoint(os.path.join(root, load_from), model, optimizer)["step"]
        resume_in_one_process(report, os.path.join(root, load_from), want_losses, want_states)
    data = list(batches(MODEL))
    for _ in range(int(steps)):
        loss = parallel_step(model, optimizer, mesh, cp, *data[step])
        compare(report, f"{layout}.step{step}", loss, pcp.full_state_dict(model), want_losses[step], want_states[step])
        step += 1
    if save_to != "-":
        pcp.save_checkpoint(os.path.join(root, save_to), model, optimizer, extra={"step": step},
                            async_save=async_save)
        report.value("latest_before_wait", pcp.latest_checkpoint(root))
        pcp.wait_checkpoint()
        report.value("latest", pcp.latest_checkpoint(root))
    if export:
        pcp.export_pretrained(model, os.path.join(root, "export"))


if __name__ == "__main__":
    run(main)
