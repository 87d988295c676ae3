"""What the launched ranks of every tool share: starting on CPU, the sep mesh over all of them, inputs drawn from a
seed, every rank's figures gathered or at their largest, median timings, and every rank's rows written as the
launch's result."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def start_cpu_ranks(nproc=None):
    """This rank on CPU in the launch's process group; its world size, checked against `nproc` when given."""
    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    dist.init_parallel_env()
    world = dist.get_world_size()
    if nproc is not None and world != nproc:
        raise ValueError(f"launched on {world} ranks but --nproc is {nproc}")
    return world


def sep_mesh(world):
    """Every rank on one sep dimension."""
    import paddle.distributed as dist

    return dist.ProcessMesh(list(range(world)), dim_names=["sep"])


def seeded_normal(seed, *shapes):
    """Standard-normal tensors of `shapes`, drawn in order after `paddle.seed(seed)`: the same on every rank and
    in the one-process reference."""
    import paddle

    paddle.seed(seed)
    return [paddle.randn(shape) for shape in shapes]


def gather(values):
    """Every rank's list of floats, as a list of lists (float64 keeps byte counts exact)."""
    import paddle
    import paddle.distributed as dist

    gathered = []
    dist.all_gather(gathered, paddle.to_tensor(values, dtype="float64"))
    return [g.numpy().tolist() for g in gathered]


def max_over_ranks(values):
    """Each of `values` (numbers) at its largest over the launched ranks."""
    import paddle
    import paddle.distributed as dist

    tensor = paddle.to_tensor(values, dtype="float64")
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.numpy().tolist()


def median_time(step, iters, warmup, before=lambda: None):
    """The median seconds of `iters` calls of `step` after `warmup` untimed ones (`before` runs untimed
    ahead of each)."""
    times = []
    for i in range(warmup + iters):
        before()
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_every_ranks_rows(result_file, rows):
    """A rank's side of `launch` for a tool whose every rank reports: its rows beside the result file, then
    rank 0 writes all of them, in rank order, as the result."""
    import paddle.distributed as dist

    Path(f"{result_file}.{dist.get_rank()}").write_text(json.dumps(rows))
    dist.barrier()
    if dist.get_rank() == 0:
        merged = [row for rank in range(dist.get_world_size())
                  for row in json.loads(Path(f"{result_file}.{rank}").read_text())]
        Path(result_file).write_text(json.dumps(merged))
