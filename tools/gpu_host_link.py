"""What host offload costs on a real GPU: the link and the host, measured (PyTorch; the GPU machine has no Paddle).

The planner (paddle_cp/cost/step_time.py) prices two host offloads: a recomputed layer's inputs copied out during
its forward and back before its backward (OffloadRecomputeInputs), and the optimizer stepped on the host
(`dp_config offload_optimizer`: gradients out, the host's AdamW, new weights back). This measures what those
terms assume, on one GPU of the machine it runs on:
- `copy`: pinned host <-> device bandwidth, each direction alone and both at once (GB/s);
- `overlap`: a bf16 GEMM loop at Llama-8B shapes alone, the copies alone, then both, the copies on a side stream:
  how much of the copy time the compute hides (1.0: all of it) and how much the GEMMs slow down;
- `host_adamw`: fp32 AdamW steps on the host's cores (PyTorch's CPU AdamW, fused where it has one): parameters per second, the
  rate of a host optimizer step (Paddle's CPU AdamW kernel is another implementation: a reference, not its figure).

Run: python3 tools/gpu_host_link.py; one JSON line per measurement, all of them in $OUT/gpu_host_link.json.
"""
import json
import os
import time

import torch

OUT = os.environ.get("OUT", "/tmp")
RESULTS = []
GIB = 2 ** 30


def say(**row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "gpu_host_link.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def timed(fn, reps):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def copy_bandwidth(nbytes=GIB, reps=5):
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h_stream, h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h():
        host_out.copy_(device_out, non_blocking=True)

    def h2d():
        device_in.copy_(host_in, non_blocking=True)

    def both():
        with torch.cuda.stream(d2h_stream):
            d2h()
        with torch.cuda.stream(h2d_stream):
            h2d()
        torch.cuda.current_stream().wait_stream(d2h_stream)
        torch.cuda.current_stream().wait_stream(h2d_stream)

    for fn in (d2h, h2d, both):
        fn()
    say(kind="copy", bytes=nbytes, d2h_gbps=round(nbytes / timed(d2h, reps) / 1e9, 2),
        h2d_gbps=round(nbytes / timed(h2d, reps) / 1e9, 2),
        both_directions_gbps_each=round(nbytes / timed(both, reps) / 1e9, 2))


def overlap(chunk=256 * 2 ** 20, gemms=40):
    """GEMMs on the compute stream; on a side stream, chunks out and back as offload moves layer inputs."""
    a = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    device_src = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    device_dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    host = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    side = torch.cuda.Stream()

    def compute():
        for _ in range(gemms):
            a @ b

    def copies(rounds):
        for i in range(rounds):
            host[i % 2].copy_(device_src, non_blocking=True)
            device_dst.copy_(host[(i + 1) % 2], non_blocking=True)

    compute()
    t_gemm = timed(compute, 1)
    t_round = timed(lambda: copies(1), 3)
    rounds = max(1, int(t_gemm / t_round))  # about as much copying as the GEMMs take

    def both():
        with torch.cuda.stream(side):
            copies(rounds)
        compute()
        torch.cuda.current_stream().wait_stream(side)

    both()
    t_copy = timed(lambda: copies(rounds), 1)
    t_both = timed(both, 1)
    hidden = (t_gemm + t_copy - t_both) / min(t_gemm, t_copy)
    flops = 2 * 16384 * 4096 * 14336 * gemms
    say(kind="overlap", gemm_ms=round(t_gemm * 1e3, 2), copy_ms=round(t_copy * 1e3, 2),
        both_ms=round(t_both * 1e3, 2), copy_hidden=round(hidden, 3),
        gemm_tflops_alone=round(flops / t_gemm / 1e12, 1), copy_bytes_each_way=rounds * chunk,
        copy_gbps_each_way_alone=round(rounds * chunk / t_copy / 1e9, 2))


def host_adamw(numel=2 ** 27, steps=3):
    threads = torch.get_num_threads()
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.randn(numel)
    try:  # the fused CPU kernel (PyTorch 2.4+), else the default
        optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
        optimizer.step()
        implementation = "fused"
    except (RuntimeError, TypeError, ValueError):
        optimizer = torch.optim.AdamW([param], lr=1e-4)
        optimizer.step()
        implementation = "default"
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    seconds = (time.perf_counter() - start) / steps
    say(kind="host_adamw", implementation=implementation, threads=threads, cpus=os.cpu_count(), numel=numel,
        params_per_second=round(numel / seconds), seconds_per_step=round(seconds, 3))


if __name__ == "__main__":
    say(kind="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    for measure in (copy_bandwidth, overlap, host_adamw):
        try:
            measure()
        except Exception as error:  # one failure must not cost the other measurements
            say(kind=measure.__name__, error=repr(error)[:300])
