"""Gradient buckets reduced during backward (data_parallel/buckets.py), on 4 gloo ranks vs one card.

Layouts (a PaddleFormers Llama, buckets of BUCKET_MB so it makes about twenty): dp2 x mp2 at sharding
levels 0, 2, 3; sep2 x dp2 (ring attention, whose backward exchanges blocks between the bucket
reductions) at levels 1 and 2; pp2 x dp2 with the tied embedding. Each trains STEPS steps of ACC
micro-batches against one card. Recorded per layout: the buckets issued during backward in steps 3-5
(with the backward position, the member gradients arrived so far, at which each was issued, against the
step's total), the host reads made from paddle_cp/data_parallel in steps 3-5 (tools/host_reads.py's `counting`, a
frame there on the stack: Tensor values read on the host, paddle.to_tensor, deferred reads), the most gradient bytes
held (the buckets' grad_bytes, a held_bytes.HeldBytes)
and the bytes of this rank's full gradients.

Then an MLP on dp4 (gradients dominate its memory): the host allocator's peak over backward and the
reduction at levels 1 and 2; a script whose backward count per step changes (1, 1, 2, 1, 3: more
passes than learned are reduced in a second round); a layer only rank 0 uses from step 3 on, and one no
rank uses until step 4 (its bucket agrees presence each step, as one card gives it no gradient until then).
"""
import contextlib
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from optimizer_amp import build, parallelized
from report import mean_over_ranks, run, train
from tensor_parallel import WELL_CONDITIONED_EPSILON

import paddle_cp as pcp
from paddle_cp.tools import host_reads
from paddle_cp.tools.allocator import allocated, peak, reset_peak

BUCKET_MB = 0.02
BATCH, SEQ, ACC, STEPS = 4, 16, 2, 5
COUNTED = (2, 3, 4)  # steps 3-5
DATA_PARALLEL = "paddle_cp/data_parallel/"


def data_parallel_reads(counts):
    """{"data_parallel": host reads, uploads and deferred reads made with paddle_cp/data_parallel on the stack
    (counting's `within`: a read in comm/ or pipeline/ made for it counts), of which "at_data_parallel" at sites
    there, "elsewhere": all others} of a HostReads (tools/host_reads.py; a read made inside a read counts once)."""
    made = counts.reads + counts.uploads + counts.deferred
    ours = counts.within[DATA_PARALLEL]
    at_sites = sum(calls for site, calls in counts.sites.items() if f" at {DATA_PARALLEL}" in site)
    return {"data_parallel": ours, "at_data_parallel": at_sites, "elsewhere": made - ours}


def batches():
    rng = np.random.RandomState(11)
    return [tuple(paddle.to_tensor(rng.randint(0, 128, [BATCH, SEQ]), dtype="int64") for _ in range(2))
            for _ in range(STEPS * ACC)]


def one_card():
    model, optimizer, scheduler = build(WELL_CONDITIONED_EPSILON)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for ids, labels in batches()[step * ACC:(step + 1) * ACC]:
            loss = model(input_ids=ids, labels=labels)[0] / ACC
            loss.backward()
            total += float(loss)
        optimizer.step()
        optimizer.clear_grad()
        scheduler.step()
        losses.append(total)
    return np.array(losses), {k: v.numpy() for k, v in model.state_dict().items()}


def layout(report, name, dims, level, want):
    sep = "sep" in dict(dims)
    mesh, model, optimizer, scheduler = parallelized(dims, level, WELL_CONDITIONED_EPSILON, sep,
                                                     bucket_size_mb=BUCKET_MB)
    buckets = optimizer.gradient_buckets
    data = batches()
    losses, issued, reads = [], [], host_reads.HostReads()
    for step in range(STEPS):
        if step == COUNTED[0]:
            buckets.grad_bytes.reset_peak()
        total = paddle.zeros([])
        with host_reads.counting(reads, within=(DATA_PARALLEL,)) if step in COUNTED else contextlib.nullcontext():
            for ids, labels in data[step * ACC:(step + 1) * ACC]:
                ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
                if sep:
                    labels = pcp.shard_sequence(labels, mesh=mesh)
                loss = model(input_ids=ids, labels=labels)[0] / ACC
                loss.backward()
                total = total + loss.detach()
            if step in COUNTED:
                issued.append({"issued": buckets.issue_log, "arrivals": buckets.arrivals,
                               "passes": buckets.passes})
            optimizer.step()
            optimizer.clear_grad()
            scheduler.step()
        dist.all_reduce(total)  # mp copies are equal: the world mean is the dp x sep mean
        losses.append(float(total) / dist.get_world_size())
    report.diff(f"{name}.loss", np.array(losses), want[0])
    state = pcp.full_state_dict(model)
    for key, value in want[1].items():
        report.diff(f"{name}.param", state[key], value)
    report.value(f"{name}.buckets", len(buckets.buckets))
    report.value(f"{name}.early_buckets", sum(b.overlaps for b in buckets.buckets))
    report.value(f"{name}.issued", issued)
    report.value(f"{name}.host_reads", data_parallel_reads(reads))
    report.value(f"{name}.grad_peak", buckets.grad_bytes.peak)
    report.value(f"{name}.grad_full", sum(bucket_bytes(b.params) for b in buckets.buckets))
    report.value(f"{name}.largest_bucket", max(bucket_bytes(b.params) for b in buckets.buckets))


def bucket_bytes(params):
    from paddle_cp.data_parallel.buckets import local_nbytes
    return sum(local_nbytes(p) for p in params)


# ---- an MLP on dp4 ------------------------------------------------------------------------------

WIDTH, DEPTH = 64, 16


class MLP(paddle.nn.Layer):
    def __init__(self, extra=False):
        super().__init__()
        self.layers = paddle.nn.LayerList([paddle.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.branch = paddle.nn.Linear(WIDTH, WIDTH)  # used by rank 0 from step 3 on (the branch case)
        self.late = paddle.nn.Linear(WIDTH, WIDTH)  # used by no rank until step 4 (the branch case)

    def forward(self, x, rank=0, step=0):
        for layer in self.layers:
            x = paddle.tanh(layer(x))
        if rank == 0 and step >= 2:
            x = self.branch(x)
        if step >= 3:
            x = self.late(x)
        return (x ** 2).mean()


def mlp(branch=False):
    """The MLP and its AdamW; without the branch case its two extra layers are frozen."""
    paddle.seed(7)
    model = MLP()
    for layer in () if branch else (model.branch, model.late):
        for p in layer.parameters():
            p.stop_gradient = True
    return model, paddle.optimizer.AdamW(learning_rate=1e-2, epsilon=1e-3, parameters=model.parameters())


def mlp_inputs(step, rank, rows=2):
    return paddle.to_tensor(np.random.RandomState(100 * step + rank).randn(rows, WIDTH).astype("float32"))


def mlp_train(model, optimizer, passes, rank=None, world=1, branch=False, after_step=None):
    """Each step: `passes[step]` backwards (loss / passes of each); one card (rank None) sums every rank's
    loss / world. Returns the losses."""
    losses = []
    for step, count in enumerate(passes):
        total = 0.0
        for micro in range(count):
            ranks = range(world) if rank is None else [rank]
            loss = sum(model(mlp_inputs(step * 10 + micro, r), r if branch else 1, step if branch else 0)
                       for r in ranks) / (count * world if rank is None else count)
            loss.backward()
            total += float(loss)
        optimizer.step()
        optimizer.clear_grad()
        losses.append(total)
        if after_step is not None:
            after_step(step)
    return np.array(losses)


def mlp_case(report, name, passes, level, branch=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = mlp(branch)
    want = mlp_train(model, optimizer, passes, world=world, branch=branch)
    want_state = {k: v.numpy() for k, v in model.state_dict().items()}
    model, optimizer = mlp(branch)
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    model, optimizer = pcp.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level,
                                                                            "bucket_size_mb": 0.1}})
    dead = []  # buckets agreeing presence each step, after each step

    issued = []  # buckets issued during backward, each step

    def count_dead(step):
        dead.append(sum(bool(b.dead) for b in optimizer.gradient_buckets.buckets))
        issued.append(len(optimizer.gradient_buckets.issue_log))

    losses = mlp_train(model, optimizer, passes, rank=rank, world=world, branch=branch, after_step=count_dead)
    total = paddle.to_tensor(losses.astype("float32"))
    dist.all_reduce(total)
    report.diff(f"{name}.loss", total.numpy() / world, want)
    state = pcp.full_state_dict(model)
    for key, value in want_state.items():
        report.diff(f"{name}.param", state[key], value)
    report.value(f"{name}.issued", issued)
    report.value(f"{name}.dead_buckets", dead)


def allocator_peak(report, level):
    """Host allocator bytes at the peak of backward + the reduction of step 3, above what was held before
    (parameters, AdamW state); gradients dropped by clear_grad(set_to_zero=False) between steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = mlp()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    model, optimizer = pcp.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level,
                                                                            "bucket_size_mb": 0.04}})
    buckets = optimizer.gradient_buckets
    for step in range(3):
        x = mlp_inputs(step, rank, rows=1)
        if step == 2:
            before = allocated()
            reset_peak()
            buckets.grad_bytes.reset_peak()
        model(x).backward()
        if step == 2:
            arrivals = buckets.arrivals
        optimizer.reduce_gradients()
        if step == 2:
            report.value(f"alloc_l{level}.peak", peak() - before)
            report.value(f"alloc_l{level}.grad_peak", optimizer.gradient_buckets.grad_bytes.peak)
            report.value(f"alloc_l{level}.issued", buckets.issue_log)
            report.value(f"alloc_l{level}.arrivals", arrivals)
            report.value(f"alloc_l{level}.buckets", len(buckets.buckets))
        optimizer.step()
        optimizer.clear_grad(set_to_zero=False)
    report.value(f"alloc_l{level}.grads", sum(p.numel().item() * 4 for p in model.parameters() if not p.stop_gradient))


# ---- a branch only the rank holding a token takes, under sep -------------------------------------------------

MARK = 7  # the token whose holder takes the branch


class RingAttention(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.qkv = paddle.nn.Linear(16, 48)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).reshape([b, s, 3, 2, 8]).unbind(2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).reshape([b, s, 16])


class Branchy(paddle.nn.Layer):
    """Attention, then a branch that a rank runs only when it holds MARK (as ERNIE-VL's image experts on a rank
    of text tokens): the same values (the branch adds nothing to other tokens), a gradient on that rank only."""

    def __init__(self):
        super().__init__()
        self.embed = paddle.nn.Embedding(32, 16)
        self.attn = RingAttention()
        self.branch = paddle.nn.Linear(16, 16)
        self.head = paddle.nn.Linear(16, 32)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = x + self.attn(x)
        marked = input_ids == MARK
        if marked.any():
            x = x + paddle.where(marked.unsqueeze(-1), self.branch(x), paddle.zeros_like(x))
        return F.cross_entropy(self.head(x), labels.unsqueeze(-1)).mean()


def branch_under_sep(report, steps=4):
    """sep over every rank (p2p), buckets of one parameter: the branch's gradient arrives on rank 0 only, before
    the attention's backward exchanges. Its buckets reduced during backward would hold rank 0 in the all-reduce
    while the others wait for it in the ring (each then fails after the watchdog's timeout, set short here)."""
    ids = np.random.RandomState(0).randint(8, 32, [1, 37])
    ids[0, 2] = MARK  # in the first chunk: rank 0's
    ids, labels = paddle.to_tensor(ids), paddle.to_tensor(np.roll(ids, -1, 1))

    def built():
        paddle.seed(3)
        model = Branchy()
        return model, paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), epsilon=1e-3)

    model, optimizer = built()
    want = train(model, optimizer, (model(ids, labels) for _ in range(steps)))
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["sep"])
    prepare = pcp.PrepareContextParallel("p2p")
    model, optimizer = built()
    model, optimizer = pcp.parallelize(model, optimizer, mesh, {
        "cp_config": {"parallelize_plan": {"": prepare, "attn": pcp.ContextParallel("p2p")}},
        "dp_config": {"bucket_size_mb": 1e-4}})
    issued = []

    def weighted_losses():
        for _ in range(steps):
            labelled = pcp.shard_sequence(labels, backend=prepare, mesh=mesh).size
            yield model(ids, labels) * pcp.loss_weight(labelled, mesh)
            issued.append([index for index, *_ in optimizer.gradient_buckets.issue_log])

    timeout = pcp.get_timeout()
    pcp.set_timeout(60)
    try:
        losses, grads, params = train(model, optimizer, weighted_losses())
    finally:
        pcp.set_timeout(timeout)
    report.training("branch_sep", (mean_over_ranks(losses, mesh), grads, params), want)
    buckets = optimizer.gradient_buckets.buckets
    report.value("branch_sep.buckets", len(buckets))
    report.value("branch_sep.uneven", [[n for n, p in model.named_parameters() if any(p is q for q in b.params)]
                                       for b in buckets if b.uneven])
    report.value("branch_sep.issued", issued)


def llama_group(report):
    want = one_card()
    layout(report, "dp2xmp2_l0", [("dp", 2), ("mp", 2)], 0, want)
    layout(report, "dp2xmp2_l2", [("dp", 2), ("mp", 2)], 2, want)
    layout(report, "dp2xmp2_l3", [("dp", 2), ("mp", 2)], 3, want)
    layout(report, "sep2xdp2_l1", [("dp", 2), ("sep", 2)], 1, want)
    layout(report, "sep2xdp2_l2", [("dp", 2), ("sep", 2)], 2, want)
    layout(report, "pp2xdp2_l0", [("pp", 2), ("dp", 2)], 0, want)


def mlp_group(report):
    allocator_peak(report, 1)
    allocator_peak(report, 2)
    mlp_case(report, "passes_change_l0", [1, 1, 2, 1, 3], 0)
    mlp_case(report, "passes_change_l2", [1, 1, 2, 1, 3], 2)
    mlp_case(report, "branch_l0", [1, 1, 1, 1, 1], 0, branch=True)
    mlp_case(report, "branch_l2", [1, 1, 1, 1, 1], 2, branch=True)
    branch_under_sep(report)


def main(report):
    for group in sys.argv[1:]:
        {"llama": llama_group, "mlp": mlp_group}[group](report)


if __name__ == "__main__":
    run(main)
