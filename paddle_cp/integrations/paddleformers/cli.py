"""`pcp-train config.yaml [key=value ...]`: `paddleformers-cli train` with paddle_cp underneath.

Reads the YAML (or JSON) and the `key=value` overrides as PaddleFormers' CLI does
(its own `read_args`), then, as its `cli.main` does, starts one rank per device
under `paddle.distributed.launch` (NNODES, RANK, MASTER_ADDR, MASTER_PORT,
CUDA_VISIBLE_DEVICES, PADDLEFORMERS_DIST_LOG read from the environment). Each rank runs
PaddleFormers' workflow with paddle_cp's Trainer (sft_workflow.run). Started inside
a launch already (`python -m paddle.distributed.launch ... $(which pcp-train) config.yaml`),
it runs the rank in place.

Without a GPU the ranks are CPU (gloo) processes: PCP_NPROC_PER_NODE of them,
by default the product of the YAML's parallel sizes (one data-parallel replica).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

USAGE = """usage: pcp-train config.yaml [key=value ...]   (also: pcp-train train config.yaml ...)

Runs PaddleFormers' `paddleformers-cli train` workflow (stages SFT and PT) with paddle_cp's
parallelism: context_parallel_size (ring), sep_parallel_size (Ulysses), both (hybrid),
tensor_model_parallel_size + sequence_parallel, sharding, pipeline_model_parallel_size,
expert_model_parallel_size. See docs/paddleformers_cli.md."""

# the YAML keys whose product is the ranks one replica needs
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "sep_parallel_size")
# a rank of a running launch has these; PaddleFormers' CLI drops them before starting its own launch
LAUNCH_ENV = ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "PADDLE_WORKERS_IP_PORT_LIST", "PADDLE_TRAINERS",
              "PADDLE_NUM_GRADIENT_SERVERS", "PADDLE_ELASTIC_JOB_ID", "PADDLE_TRAINER_ENDPOINTS",
              "DISTRIBUTED_TRAINER_ENDPOINTS", "FLAGS_START_PORT", "PADDLE_ELASTIC_TIMEOUT")
# what PaddleFormers' CLI sets for its ranks unless the environment says otherwise (TF32 off: fp32 stays fp32)
RANK_ENV_DEFAULTS = {"FLAGS_set_to_1d": "False", "NVIDIA_TF32_OVERRIDE": "0",
                     "FLAGS_dataloader_use_file_descriptor": "False"}
PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])  # the folder holding paddle_cp/


def read_config(argv):
    """The arguments dict PaddleFormers' CLI builds from `config.yaml key=value ...` (its `read_args`,
    which reads them from sys.argv after the `train` command)."""
    from paddleformers.cli.hparams.parser import read_args

    if not argv or not argv[0].endswith((".yaml", ".yml", ".json")):
        raise SystemExit(f"pcp-train needs a YAML or JSON config first, got {argv[:1]}\n\n{USAGE}")
    saved = sys.argv
    sys.argv = [saved[0], "train", *argv]
    try:
        return read_args()
    finally:
        sys.argv = saved


def cpu_ranks(config):
    """Ranks on a machine without GPUs: PCP_NPROC_PER_NODE, else one replica of the YAML's parallel sizes."""
    if os.environ.get("PCP_NPROC_PER_NODE"):
        return int(os.environ["PCP_NPROC_PER_NODE"])
    return math.prod(max(int(config.get(key, 1)), 1) for key in PARALLEL_SIZES)


def launch_command(argv, config):
    """paddle.distributed.launch over this node's devices, each rank running `python -m paddle_cp.train`."""
    import paddle

    command = [sys.executable, "-m", "paddle.distributed.launch",
               "--log_dir", os.environ.get("PADDLEFORMERS_DIST_LOG", "paddleformers_dist_log")]
    gpus = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
    if gpus:
        command += ["--gpus", os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus))))]
    else:
        command += ["--nproc_per_node", str(cpu_ranks(config))]
    nnodes = os.environ.get("NNODES", "1")
    if nnodes != "1" or "MASTER_ADDR" in os.environ:  # one node finds its own free port
        master = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '8080')}"
        command += ["--master", master, "--nnodes", nnodes, "--rank", os.environ.get("RANK", "0")]
    # a training script not ending in .py is run as given: the interpreter, then `-m paddle_cp.train ...`
    return command + ["--run_mode=collective", sys.executable, "-m", "paddle_cp.train", *argv]


def launch(argv, config):
    env = {**RANK_ENV_DEFAULTS, **{key: value for key, value in os.environ.items() if key not in LAUNCH_ENV}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.call(launch_command(argv, config), env=env)


def run_rank(config):
    """This rank's part of the run (inside a launch, or the only process)."""
    import paddle

    from .sft_workflow import run

    if "device" not in config and not paddle.is_compiled_with_cuda():
        config = {**config, "device": "cpu"}  # PaddleFormers' default "gpu" cannot start on a CPU build
    run(config)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    config = read_config(argv)
    if "PADDLE_TRAINER_ID" in os.environ:
        run_rank(config)
        return 0
    from .sft_workflow import check_config

    check_config(config)  # before any rank starts: a bad key costs no launch
    return launch(argv, config)
