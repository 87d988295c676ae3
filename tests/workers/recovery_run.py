"""A training job under pcp.Resumable that kills itself as a spec says, for the elastic-launch tests
(tests/multiproc/test_recovery.py).

argv: root steps save_every faults
  root: the job's checkpoints; steps: the run's length; save_every: its checkpoint interval;
  faults: JSON [{"rank", "step", "phase"}], phase one of forward, backward, save (SIGKILL while this rank's
  writer thread writes the async save made after `step`), sigterm (SIGTERM to itself in the forward), node (SIGKILL
  to its launcher, then to itself: a node lost), raise (a ValueError in the forward on every attempt, and exit 1). Every fault
  but raise fires once per job: `<root>/faults/fired-<i>` records it (with the attempt it hit) before the rank dies.

The job: PaddleFormers' tiny Llama under ring attention over every rank (one card when one is left), AdamW with a
warm-up + cosine LR schedule (a Resumable object), batches drawn from Paddle's and numpy's global generators each
step (a resumed step draws what the uninterrupted one drew only if every generator was restored). The attempt that
finishes (or is preempted) reports its losses, and then, finished, trains the same job uninterrupted in the same
processes (a fresh root) and reports those losses too.
"""
import json
import os
import signal
import sys
import traceback

import numpy as np
import paddle
import paddle.distributed as dist
from report import run

import paddle_cp as pcp
from paddle_cp.checkpoint import api as checkpoint_api
from paddle_cp.checkpoint import commit
from paddle_cp.comm import counters

VOCAB, BATCH, SEQ = 64, 2, 24


def build(world):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(11)
    np.random.seed(11)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False,
                                         max_position_embeddings=SEQ))
    schedule = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(3e-3, T_max=20), 3, 0.0,
                                                3e-3)
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, epsilon=1e-3, parameters=model.parameters())
    if world > 1:
        mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
        plan = {"": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
        model, optimizer = pcp.parallelize(model, optimizer, mesh, {"cp_config": {"parallelize_plan": plan}})
    return model, optimizer, schedule


def batch():
    """Tokens from Paddle's generator, one in four replaced from numpy's: both streams must resume exactly."""
    ids = paddle.randint(0, VOCAB, [BATCH, SEQ + 1])
    noise = np.random.randint(0, VOCAB, [BATCH, SEQ + 1])
    keep = np.random.rand(BATCH, SEQ + 1) > 0.25
    ids = paddle.where(paddle.to_tensor(keep), ids, paddle.to_tensor(noise, dtype=ids.dtype))
    return ids[:, :-1], ids[:, 1:]


class BadSample(ValueError):
    """The fault `raise`: a step that fails on every attempt (the peers fail in their next collective)."""


class Faults:
    """This rank's faults of this job; `now(step, phase)` fires the one due."""

    def __init__(self, root, specs):
        self.root, self.rank = root, dist.get_rank()
        self.specs = [(i, spec) for i, spec in enumerate(specs) if spec["rank"] == self.rank]
        self.step, self.attempt = None, None

    def now(self, phase, step=None):
        step = self.step if step is None else step
        for i, spec in self.specs:
            if spec["phase"] != phase or spec["step"] != step:
                continue
            if phase == "raise":
                raise BadSample(f"a bad sample in step {step}")
            mark = os.path.join(self.root, "faults", f"fired-{i}")
            if os.path.exists(mark):
                continue
            os.makedirs(os.path.dirname(mark), exist_ok=True)
            with open(mark, "w") as f:
                json.dump({**spec, "attempt": self.attempt}, f)
            if phase == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
                continue
            sys.stdout.flush()
            if phase == "node":
                os.kill(os.getppid(), signal.SIGKILL)  # its launcher: no pod left on this "node"
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self, model):
        layers = model.model.layers
        layers[1].register_forward_pre_hook(lambda layer, inputs: self.now("forward"))
        layers[1].register_forward_pre_hook(lambda layer, inputs: self.now("sigterm"))
        layers[1].register_forward_pre_hook(lambda layer, inputs: self.now("raise"))
        layers[1].register_forward_pre_hook(lambda layer, inputs: self.now("node"))

        def in_backward(layer, inputs, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if not hidden.stop_gradient:
                hidden.register_hook(lambda grad: self.now("backward") or grad)

        layers[0].register_forward_post_hook(in_backward)
        writing = checkpoint_api.write_state

        def write_state(directory, files, copied):  # the writer thread: model_state written, then the kill
            writing(directory, files, copied)
            self.now("save", step=int(os.path.basename(os.path.dirname(directory)).split("-")[1].split(".")[0]))

        checkpoint_api.write_state = write_state


def train(root, steps, save_every, faults=None, fresh=False):
    """(losses, the Resumable) of the job under `root`."""
    world = dist.get_world_size()
    model, optimizer, schedule = build(world)
    if faults is not None:
        faults.install(model)
    with pcp.Resumable(root, model, optimizer, save_every=save_every, keep_latest=2, objects={"lr": schedule},
                       extra={"losses": []}, tries_per_step=2, fresh=fresh) as job:
        if faults is not None:
            faults.attempt = job.attempt
        for step in job.steps(steps):
            if faults is not None:
                faults.step = step + 1
            ids, labels = batch()
            local = pcp.shard_sequence(labels, mesh=pcp.get_mesh()) if world > 1 else labels
            weight = pcp.loss_weight(local.numel(), pcp.get_mesh()) if world > 1 else 1.0
            loss = model(input_ids=ids, labels=labels)[0] * weight
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            schedule.step()
            total = loss.detach().clone()
            if world > 1:
                dist.all_reduce(total)
            job.extra["losses"].append(float(total) / world)
    return job.extra["losses"], job


def main(report):
    root, steps, save_every, specs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    counters.reset()
    try:
        losses, job = train(root, steps, save_every, Faults(root, specs))
    except Exception:  # noqa: BLE001 - a failed rank exits non-zero (report.run would exit 0): the job restarts
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    report.value("world", dist.get_world_size())
    report.value("attempt", job.attempt)
    report.value("resumed_from", job.resumed_from)
    report.value("preempted", job.preempted)
    report.value("losses", losses)
    report.value("steps_done", job.step)
    report.value("boundary_collectives", counters.collectives_issued("step_boundary"))
    report.value("boundary_bytes", counters.bytes_sent("step_boundary"))
    report.value("latest", pcp.latest_checkpoint(root))
    if dist.get_rank() == 0:  # the one that prunes
        report.value("checkpoints", [os.path.basename(path) for _, path in commit.complete_checkpoints(root)])
    if job.step == steps:  # finished: the same job, never interrupted, in these processes
        report.value("uninterrupted", train(f"{root}.uninterrupted", steps, save_every, fresh=True)[0])


if __name__ == "__main__":
    run(main)
