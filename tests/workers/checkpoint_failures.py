"""Failures during a run on 2 ranks of PaddleFormers Llama under context parallelism (sep2).

argv: kill root   -- step, save checkpoint-1, step, start checkpoint-2 and kill rank 1 as its
                     files start being written
      stall root T -- set_timeout(T); step; then rank 1 stalls while rank 0 enters the next step
Ranks write `<name>.json` to PCP_REPORT_DIR (times from time.time()) before the failure.
"""
import json
import os
import sys
import time

import paddle.distributed as dist
from checkpoint_resume import LAYOUTS, MODEL, parallel_model, parallel_step
from tensor_parallel import batches

import paddle_cp as pcp
from paddle_cp.checkpoint import api


def note(name, **values):
    with open(os.path.join(os.environ["PCP_REPORT_DIR"], f"{name}.json"), "w") as f:
        json.dump({"time": time.time(), **values}, f)


def die_when_writing(*args, **kwargs):
    note("killed", rank=dist.get_rank())
    os._exit(9)


def kill(root):
    model, optimizer, mesh, cp = parallel_model(False, **LAYOUTS["sep2"])
    data = list(batches(MODEL))
    parallel_step(model, optimizer, mesh, cp, *data[0])
    pcp.save_checkpoint(os.path.join(root, "checkpoint-1"), model, optimizer, extra={"step": 1})
    parallel_step(model, optimizer, mesh, cp, *data[1])
    if dist.get_rank() == 1:
        api.write_state = die_when_writing
    pcp.save_checkpoint(os.path.join(root, "checkpoint-2"), model, optimizer, extra={"step": 2})
    note(f"survived{dist.get_rank()}")  # never reached: the save cannot complete


def stall(seconds):
    pcp.set_timeout(seconds)
    model, optimizer, mesh, cp = parallel_model(False, **LAYOUTS["sep2"])
    data = list(batches(MODEL))
    parallel_step(model, optimizer, mesh, cp, *data[0])
    if dist.get_rank() == 1:
        time.sleep(600)  # a wedged rank: alive, never reaching the next collective
    note("stall_start", timeout=pcp.get_timeout())
    parallel_step(model, optimizer, mesh, cp, *data[1])
    note("survived0")  # never reached: rank 1 never joins


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(sys.argv[2])
    else:
        stall(float(sys.argv[3]))
