"""What the host optimizer's step costs per rank on a GPU machine (PyTorch; the GPU machine has no Paddle).

tools/gpu_host_link.py measured pinned copies and one AdamW over all host threads. paddle_cp's host optimizer
(dp_config offload_optimizer) copies to and from plain (pageable) CPU tensors, and every rank of a node steps
its own share on the host at once, one thread each (Paddle's CPU AdamW kernel is single-threaded). This measures:
- `pageable_copy`: device <-> pageable host memory, bf16, GB/s each way;
- `host_step`: `ranks` processes at once, one thread each, each stepping its share as the host optimizer does:
  the bf16 gradient cast to fp32, an fp32 AdamW step (PyTorch's fused CPU kernel, or its unfused one), the new
  value cast to bf16; parameters/s per rank. What 8 ranks on one host cost each other, not Paddle's rate.

Run: python3 tools/gpu_host_step.py; one JSON line per measurement, all of them in $OUT/gpu_host_step.json.
"""
import json
import multiprocessing as mp
import os
import time

import torch

OUT = os.environ.get("OUT", "/tmp")
RESULTS = []


def say(**row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "gpu_host_step.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def pageable_copy(numel=2 ** 29, reps=3):
    device = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(numel, dtype=torch.bfloat16)  # not pinned
    host.copy_(device)
    device.copy_(host)
    rates = {}
    for name, fn in (("d2h_gbps", lambda: host.copy_(device)), ("h2d_gbps", lambda: device.copy_(host))):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        rates[name] = round(numel * 2 * reps / (time.perf_counter() - start) / 1e9, 2)
    say(kind="pageable_copy", bytes=numel * 2, **rates)


def _step_worker(numel, steps, fused, queue):
    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.zeros(numel))
    optimizer = torch.optim.AdamW([param], lr=1e-4, **({"fused": True} if fused else {"foreach": False}))
    gradient = torch.randn(numel).to(torch.bfloat16)

    def step():
        param.grad = gradient.float()
        optimizer.step()
        return param.detach().to(torch.bfloat16)

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    queue.put(numel * steps / (time.perf_counter() - start))


def host_step(ranks, fused, numel=2 ** 25, steps=3):
    context = mp.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_step_worker, args=(numel, steps, fused, queue)) for _ in range(ranks)]
    for worker in workers:
        worker.start()
    rates = [queue.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join()
    say(kind="host_step", fused=fused, ranks=ranks, threads_each=1, cpus=os.cpu_count(), numel=numel,
        params_per_second_per_rank_min=round(min(rates)), params_per_second_per_rank_mean=round(sum(rates) / ranks))


if __name__ == "__main__":
    say(kind="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    for measure, args in ((pageable_copy, ()), *((host_step, (ranks, fused)) for fused in (False, True)
                                                   for ranks in (1, 8))):
        try:
            measure(*args)
        except Exception as error:  # one failure must not cost the other measurements
            say(kind=measure.__name__, error=repr(error)[:300])
