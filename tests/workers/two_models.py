"""Two models in one process (4 ranks), each against one card (tensor_parallel.reference: 3 AdamW steps,
epsilon 1e-3, fp32): one context-parallel plan dict serving both, trained step by step in turn on
different meshes (Llama on sep4, Phi-3 on dp2 x sep2: each model's run state, not the plan, holds its
groups, signature and batch check); both released, F.scaled_dot_product_attention is Paddle's own again;
then, after paddle_cp.runtime.reset(), a third model parallelized in the same process (Llama, tensor +
sequence parallel on dp2 x mp2) trains exactly too.
"""
import gc

import numpy as np
import paddle.distributed as dist
import paddle.nn.functional as F
from report import run
from tensor_parallel import WELL_CONDITIONED_EPSILON, batches, build, positions, reference
from tensor_parallel import sequence_parallel_plan

import paddle_cp as pcp
from paddle_cp import runtime


def mesh_of(shape, names):
    return dist.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=names)


class Trainee:
    """One parallelized model, its optimizer and losses (the mean over the mesh's ranks)."""

    def __init__(self, name, mesh, config):
        self.name, self.mesh = name, mesh
        model, optimizer = build(name, WELL_CONDITIONED_EPSILON)
        self.model, self.optimizer = pcp.parallelize(model, optimizer, mesh, config)
        self.prepare = config.get("cp_config", {}).get("parallelize_plan", {}).get("model")
        self.losses = []

    def step(self, ids, labels):
        ids, labels = pcp.shard_batch((ids, labels), mesh=self.mesh) if "dp" in self.mesh.dim_names else (ids, labels)
        if self.prepare is not None:
            labels = pcp.shard_sequence(labels, backend=self.prepare, mesh=self.mesh)
        loss = self.model(input_ids=ids, labels=labels, position_ids=positions(ids.shape[0]))[0]
        loss.backward()
        self.optimizer.step()
        self.optimizer.clear_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # mp copies are equal: the world mean is the dp x sep mean
        self.losses.append(float(total) / 4)

    def compare(self, report, label):
        want_losses, _, want_state = reference(self.name, WELL_CONDITIONED_EPSILON)
        report.diff(f"{label}.loss", np.array(self.losses), want_losses)
        state = pcp.full_state_dict(self.model)
        report.value(f"{label}.state_keys_match", sorted(state) == sorted(want_state))
        for key, value in want_state.items():
            report.diff(f"{label}.state.{key}", state.get(key, np.zeros([0])), value)


def main(report):
    own_sdpa = F.scaled_dot_product_attention
    plan = {"model": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    shared = [Trainee("llama", mesh_of([4], ["sep"]), {"cp_config": {"parallelize_plan": plan}}),
              Trainee("phi3", mesh_of([2, 2], ["dp", "sep"]), {"cp_config": {"parallelize_plan": plan}})]
    for (ids, labels), (phi_ids, phi_labels) in zip(batches("llama"), batches("phi3")):
        shared[0].step(ids, labels)
        shared[1].step(phi_ids, phi_labels)
    shared[0].compare(report, "one_plan.llama_sep4")
    shared[1].compare(report, "one_plan.phi3_dp2_sep2")
    report.value("plan_state", sorted(k for plan_object in plan.values() for k in vars(plan_object)
                                      if k.startswith("_")))
    del shared
    gc.collect()  # the models' hooks and their run state form cycles
    report.value("sdpa_restored_after_release", F.scaled_dot_product_attention is own_sdpa)
    runtime.reset()
    tensor_parallel = {"mp_config": {"parallelize_plan": sequence_parallel_plan()}}
    after = Trainee("llama", mesh_of([2, 2], ["dp", "mp"]), tensor_parallel)
    for ids, labels in batches("llama"):
        after.step(ids, labels)
    after.compare(report, "after_reset.llama_dp2_mp2_sp")


run(main)
