"""Train a small Llama with context parallelism on CPU (gloo) or GPU (NCCL) ranks.

    python -m paddle.distributed.launch --nproc_per_node 4 \
        examples/train_llama_cp.py --config examples/configs/cp4_p2p.yaml

The YAML holds the mesh and the plans (see paddle_cp.load_config) and a
`train` section. Prints the loss and tokens/s of every step, then replays the
same steps in one process and reports how far the losses are apart.

The run is resumable (pcp.Resumable, docs/recovery.md): a checkpoint in `--checkpoint-dir`
(by default runs/<config>/checkpoints) every `--save-every` steps, written in the background,
and at the end; started again it continues from the newest committed one, on whatever mesh
the YAML describes now (`--fresh` starts over); SIGTERM or SIGUSR1 saves and stops every rank.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import paddle
import paddle.distributed as dist
import yaml
from llama_models import build_llama, loss_of

import paddle_cp as pcp

TRAIN_DEFAULTS = dict(model="auto", seq_len=256, batch_size=2, steps=10, learning_rate=1e-3, seed=2024,
                      compare=True)


def batches(train, vocab_size=128, start_step=0):
    """Deterministic batches with learnable structure: each token predicts the next by a fixed rule.
    From `start_step` on (the earlier ones are drawn and skipped: the data position of a resumed run)."""
    rng = np.random.default_rng(train["seed"])
    for step in range(train["steps"]):
        start = rng.integers(0, vocab_size, size=(train["batch_size"], 1))
        tokens = (start + 7 * np.arange(train["seq_len"] + 1)) % vocab_size
        noise = rng.random(tokens.shape) < 0.1
        tokens = np.where(noise, rng.integers(0, vocab_size, tokens.shape), tokens)
        if step >= start_step:
            ids = paddle.to_tensor(tokens, dtype="int64")
            yield ids[:, :-1], ids[:, 1:]


def new_model_and_optimizer(train):
    paddle.seed(train["seed"])
    model = build_llama(train["model"], **train.get("model_config", {}))  # e.g. PaddleFormers' recompute flags
    return model, paddle.optimizer.AdamW(learning_rate=train["learning_rate"], parameters=model.parameters())


def input_splitter(config):
    """The config's PrepareContextParallel plan (it knows which tokens this rank gets)."""
    for plans in (config.get("cp_config") or {}).get("parallelize_plan", {}).values():
        for plan in plans if isinstance(plans, list) else [plans]:
            if isinstance(plan, pcp.PrepareContextParallel):
                return plan
    raise ValueError("this example needs a PrepareContextParallel plan in cp_config")


def train_parallel(train, mesh, config, checkpoints, save_every=0, fresh=False):
    """(the step this run started from, its losses)."""
    model, optimizer = new_model_and_optimizer(train)
    model, optimizer = pcp.parallelize(model, optimizer, mesh, config)
    splitter = input_splitter(config)
    replicas = dist.get_world_size()
    losses = []
    with pcp.Resumable(checkpoints, model, optimizer, save_every=save_every, fresh=fresh) as run:
        first = run.step
        data = batches(train, start_step=first)
        for step in run.steps(train["steps"]):
            ids, labels = next(data)
            start = time.perf_counter()
            # this rank's mean over its tokens, weighted by its share when the length does not divide
            weight = pcp.loss_weight(pcp.shard_sequence(labels, backend=splitter, mesh=mesh).numel(), mesh)
            loss = loss_of(model(input_ids=ids, labels=labels)) * weight
            loss.backward()
            optimizer.step()  # averages gradients over the context-parallel ranks first
            optimizer.clear_grad()
            elapsed = time.perf_counter() - start
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / replicas)
            if dist.get_rank() == 0:
                tokens = ids.shape[0] * ids.shape[1]
                print(f"step {step:3d}  loss {losses[-1]:.6f}  tokens/s {tokens / elapsed:9.1f}", flush=True)
    return first, losses


def train_single(train):
    model, optimizer = new_model_and_optimizer(train)
    losses = []
    for ids, labels in batches(train):
        loss = loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses


def main(argv=None):
    """Returns (losses, one-process losses, largest difference) on rank 0 (None without the comparison)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML with mesh, *_config sections and train")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--checkpoint-dir", help="where checkpoints go (default: runs/<config name>/checkpoints)")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: at the end)")
    parser.add_argument("--fresh", action="store_true", help="start over (by default the run continues from the "
                        "newest checkpoint)")
    args = parser.parse_args(argv)
    if args.save_every < 0:
        parser.error("--save-every takes a number of steps >= 0")
    with open(args.config) as f:
        description = yaml.safe_load(f)
    train = {**TRAIN_DEFAULTS, **description.pop("train", {})}
    if args.steps:
        train["steps"] = args.steps
    mesh, config = pcp.load_config(description)
    if dist.get_rank() == 0:
        print(f"mesh {mesh.shape} {mesh.dim_names}, model {train['model']}, seq {train['seq_len']}, "
              f"batch {train['batch_size']}", flush=True)
    checkpoints = args.checkpoint_dir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0],
                                                      "checkpoints")
    first, losses = train_parallel(train, mesh, config, checkpoints, args.save_every, args.fresh)
    if train["compare"] and losses and dist.get_rank() == 0:
        reference = train_single(train)[first:]
        gap = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"single process losses {[round(x, 6) for x in reference]}")
        print(f"max |loss - single-process loss| over {len(losses)} steps: {gap:.2e}", flush=True)
        return losses, reference, gap
    return None


if __name__ == "__main__":
    main()
