"""The main job: long-context training on real text, context parallel over CPU (gloo) or GPU ranks.

    python -m paddle.distributed.launch --nproc_per_node 4 examples/train_long_context.py

PaddleFormers' LlamaForCausalLM, built from a config (defaults otherwise: eager attention), learns the
source files of Python's standard library as bytes (stdlib_text.py: one document per file, packed into
sequences of --seq-len tokens). Attention stays inside each document: PrepareContextParallel(
documents="position_ids") reads the documents from the restarting position ids and splits each batch in
the layout a GPU would finish first by paddle_cp's tile model (printed once: the predicted slowest rank's
ms beside 2N equal chunks', and the ranks' query-key work balance in both).
Ring attention (p2p) runs over all ranks; each rank's mean loss is weighted by pcp.loss_weight, since
the ranks hold different numbers of labelled tokens. Rank 0 prints a progress line per step. The run is resumable
(pcp.Resumable, docs/recovery.md): a checkpoint every --save-every steps, written in the background; started again
(by hand, or by Paddle's elastic launch after a rank died) it continues from the newest committed one, with the
data position and every generator, and its losses are those of a run never stopped (--fresh starts over); SIGTERM
or SIGUSR1 to any rank saves at the next step boundary and stops every rank. At the end rank 0 replays the same steps
in one process with PaddleFormers' own mask for packed documents (attn_mask_startend_row_indices),
prints both losses falling and their largest difference, and writes the curves to --out as loss.csv
and loss.png (the PNG needs matplotlib: pip install -e ".[examples]").
"""
from __future__ import annotations

import argparse
import os
import time

import paddle
import paddle.distributed as dist
from loss_curve import write_csv, write_png
from stdlib_text import IGNORE, VOCAB_SIZE, packed_batches

import paddle_cp as pcp


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per packed sequence (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step (default: %(default)s)")
    parser.add_argument("--max-document", type=int, default=1536,
                        help="bytes kept of each file, BOS and EOS included (default: %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="AdamW's (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=2024, help="(default: %(default)s)")
    parser.add_argument("--out", default="runs/long_context", help="checkpoints and loss curves (default: %(default)s)")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints, 0: only at the end "
                        "and when preempted (default: %(default)s)")
    parser.add_argument("--fresh", action="store_true", help="start over: remove the checkpoints in --out (by "
                        "default the run continues from the newest)")
    args = parser.parse_args(argv)
    for name in ("steps", "seq_len", "batch_size", "max_document", "hidden_size", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} takes a number >= 1")
    if args.save_every < 0:
        parser.error("--save-every takes a number of steps >= 0")
    return args


def new_model_and_optimizer(args):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(args.seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 3,
                         num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=args.max_document,
                         fuse_rms_norm=False)  # the fused norm has no CPU kernel
    model = LlamaForCausalLM(config)
    return model, paddle.optimizer.AdamW(learning_rate=args.learning_rate, parameters=model.parameters())


def batches(args, start_step=0):
    """Each step's batch as paddle tensors, from `start_step` on (the data position of a resumed run)."""
    for step, batch in enumerate(packed_batches(args.steps, args.batch_size, args.seq_len, args.max_document)):
        if step >= start_step:
            yield step, {name: paddle.to_tensor(value) for name, value in batch._asdict().items()}


class Progress:
    """One line per step: loss, tokens/s, elapsed and remaining time of this phase."""

    def __init__(self, phase, first_step, last_step, tokens_per_step):
        self.phase, self.first, self.last, self.tokens = phase, first_step, last_step, tokens_per_step
        self.started = self.step_started = time.perf_counter()

    def step(self, step, loss):
        now = time.perf_counter()
        done = step + 1 - self.first
        elapsed, remaining = now - self.started, (now - self.started) / done * (self.last - step - 1)
        print(f"{self.phase} step {step + 1:3d}/{self.last}  loss {loss:.4f}  "
              f"tokens/s {self.tokens / (now - self.step_started):7.0f}  "
              f"elapsed {_clock(elapsed)}  remaining {_clock(remaining)}", flush=True)
        self.step_started = now


def _clock(seconds):
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def checkpoint_root(args):
    return os.path.join(args.out, "checkpoints")


def work_imbalance(prepare, mesh, position_ids):
    """The slowest rank's attention work over the mean, in `prepare`'s layout of this batch; a rank's work
    is the keys its queries see, each query's position in its document + 1 (one all-gather)."""
    local = pcp.shard_sequence(position_ids, backend=prepare, mesh=mesh, position_ids=position_ids)
    gathered = []
    dist.all_gather(gathered, (local + 1).sum().astype("float64").reshape([1]))
    work = [w.item() for w in gathered]
    return max(work) / (sum(work) / len(work))


def predicted_gpu_ms(position_ids, world):
    """{layout: ms} of the slowest rank's attention (forward + backward of one layer) on an H200, as the
    GPU tile model prices this batch (paddle_cp/tools/bench/gpu_layouts.py; no GPU runs): the layout the plan
    chose, 2N equal chunks and whole documents."""
    from paddle_cp.tools.bench.gpu_layouts import layout_rows

    rows = {row["layout"]: row for row in layout_rows(position_ids.numpy(), "p2p", world)}
    print(f"predicted GPU attention per layer (tile model, H200 fwd+bwd; no GPU ran): slowest rank "
          f"{rows['chosen']['slowest_ms']:.2f} ms in the chosen '{rows['chosen']['candidate']}' layout, "
          f"{rows['chunks']['slowest_ms']:.2f} ms with 2N equal chunks ({rows['chosen']['vs_chunks']:.3f}x)",
          flush=True)
    return {name: row["slowest_ms"] for name, row in rows.items()}


def train_parallel(args):
    """Every rank: train under context parallelism, from the newest checkpoint; returns every step's loss (the
    global mean; the steps before the checkpoint's from it), the work imbalance of this run's first batch in both
    layouts (None when nothing was left to train) and how many ranks a preemption signal reached (0: none)."""
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    prepare = pcp.PrepareContextParallel("p2p", documents="position_ids")
    plan = {
        "": prepare,  # the model itself: splits input_ids, labels and position_ids over sep
        "model.layers.*.self_attn": pcp.ContextParallel("p2p"),  # its attention runs as a ring
    }
    model, optimizer = new_model_and_optimizer(args)
    model, optimizer = pcp.parallelize(model, optimizer, mesh, {"cp_config": {"parallelize_plan": plan}})
    balance = None
    with pcp.Resumable(checkpoint_root(args), model, optimizer, save_every=args.save_every, fresh=args.fresh,
                       extra={"losses": []}) as run:
        progress = Progress("parallel", run.step, args.steps, args.batch_size * args.seq_len)
        data = batches(args, run.step)
        for step in run.steps(args.steps):
            batch = next(data)[1]
            if balance is None:  # the balance the documents layout gives, beside the 2N chunks' on the same batch
                chunks = pcp.PrepareContextParallel("p2p", documents="position_ids", layout="chunks")
                balance = {name: work_imbalance(plan, mesh, batch["position_ids"])
                           for name, plan in (("documents", prepare), ("chunks", chunks))}
                if dist.get_rank() == 0:
                    print(f"per-rank attention work, slowest over mean: {balance['documents']:.3f} "
                          f"({balance['chunks']:.3f} with 2N equal chunks)", flush=True)
                    balance["gpu_ms"] = predicted_gpu_ms(batch["position_ids"], world)
            # the batch's documents decide how it is split: labels follow with the same position ids
            local_labels = pcp.shard_sequence(batch["labels"], backend=prepare, mesh=mesh,
                                              position_ids=batch["position_ids"])
            # this rank's mean over its labelled tokens, weighted by its share of all of them
            weight = pcp.loss_weight(int((local_labels != IGNORE).sum()), mesh)
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"],
                         position_ids=batch["position_ids"])[0] * weight
            loss.backward()
            optimizer.step()  # averages the gradients over the ranks first
            optimizer.clear_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)  # sum of the weighted means = world x the global mean
            run.extra["losses"].append(float(total) / world)
            if dist.get_rank() == 0:
                progress.step(step, run.extra["losses"][-1])
    return run.extra["losses"], balance, run.preempted


def replay_single(args):
    """The same steps in one process, as PaddleFormers runs packed documents on one card."""
    model, optimizer = new_model_and_optimizer(args)
    progress = Progress("one-process", 0, args.steps, args.batch_size * args.seq_len)
    losses = []
    for step, batch in batches(args):
        ends = batch["document_ends"].unsqueeze([1, 3])  # [b, 1, s, 1]: key j is seen by rows j..end-1
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                     attn_mask_startend_row_indices=ends)[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
        progress.step(step, losses[-1])
    return losses


def main(argv=None):
    """Returns (losses, one-process losses, largest difference, first batch's work imbalance by layout) on
    rank 0, None elsewhere and when preempted."""
    args = parse_args(argv)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, ring attention; Llama hidden {args.hidden_size}, {args.layers} layers; "
              f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens of packed stdlib files", flush=True)
    losses, balance, preempted = train_parallel(args)
    if dist.get_rank() != 0 or preempted:
        return None
    print(f"loss fell from {losses[0]:.4f} (step 1) to {losses[-1]:.4f} (step {len(losses)}); "
          f"replaying the {len(losses)} steps in one process", flush=True)
    reference = replay_single(args)
    gap = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"one process: loss {reference[0]:.4f} -> {reference[-1]:.4f}; "
          f"max |loss - one-process loss| over {len(losses)} steps: {gap:.2e}", flush=True)
    written = [write_csv(os.path.join(args.out, "loss.csv"), losses, reference)]
    written.append(write_png(os.path.join(args.out, "loss.png"), losses, reference,
                             title=f"{dist.get_world_size()} ranks vs one process: max |difference| {gap:.1e}"))
    print("wrote " + ", ".join(path for path in written if path), flush=True)
    return losses, reference, gap, balance


if __name__ == "__main__":
    main()
