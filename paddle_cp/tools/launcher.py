"""Start CPU ranks under `paddle.distributed.launch`: the one launcher of the tools (pcp-bench, pcp-bench-pp,
pcp-memory, pcp-selftest) and of the test suite (tests/launcher.py); what the ranks share is tools/ranks.py.

`elastic_command` is the same through pcp-launch (Paddle's elastic mode: the tests of recovery).
A tool launches its own file as the ranks' script (`launch(args, argv, script=__file__)`); the ranks see
PADDLE_TRAINER_ID set, measure, and rank 0 writes the result to `--result-file`, which `launch` returns.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # holds the paddle_cp package: the ranks import it from here
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
PROGRESS = "[pcp-"  # how every tool's progress line starts, on either side of a launch

# Paddle 3.3.1 on CPU sometimes loses a rank to a signal with no Python error (SIGABRT at start-up or in the
# teardown of a rank whose work was done, SIGSEGV in that teardown; about once in a hundred launches of the test
# suite) whatever the script: such a run goes once more. A crash of the script itself crashes again, and a failure
# of any other kind is reported at once. The launch prints "... code -6" (or -11) for the lost rank.
LOST_TO = {-6: "SIGABRT", -11: "SIGSEGV"}


def lost_signal(returncode, output):
    """The signal ('SIGABRT', 'SIGSEGV') a run that exited with `returncode` and printed `output` lost a rank (or
    itself) to; None for a success or a failure of another kind."""
    if returncode == 0:
        return None
    if returncode in LOST_TO:
        return LOST_TO[returncode]
    code = re.search(r"code (-6|-11)\b", output)
    return LOST_TO[int(code.group(1))] if code else None


def retrying_an_abort(run, name, fresh=()):
    """`run()` (-> (returncode, output, anything)), once more if a rank was lost to a signal, with a warning that
    quotes what the lost rank printed (the launch shows its log's tail); the folders in `fresh` are emptied before
    the second run."""
    result = run()
    signal = lost_signal(*result[:2])
    if signal:
        warnings.warn(f"a rank of {name} was lost to {signal}; launched once more{_abort_report(result[1])}")
        for folder in fresh:
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
        result = run()
    return result


def _abort_report(output):
    """The stacks the lost rank printed (Python's faulthandler, Paddle's signal summary), if it printed any."""
    found = [output.find(mark) for mark in ("Fatal Python error", "C++ Traceback", "SIGABRT", "SIGSEGV")
             if mark in output]
    return f":\n{output[min(found):][:3000]}" if found else ""


def command(nproc, script, argv, log_dir):
    """The `paddle.distributed.launch` command running `script argv` on `nproc` CPU ranks."""
    return [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
            "--log_dir", str(log_dir), str(script), *map(str, argv)]


def elastic_command(master, job_id, nproc, nnodes, log_dir, script, argv, elastic_timeout=None, max_restart=6):
    """pcp-launch (Paddle's launch in its elastic mode, tools/elastic/cli.py) of `script argv` on `nproc` CPU ranks
    of one pod of a job of `nnodes` pods ("1", or "1:2": elastic in their number), its etcd at `master`."""
    cmd = [sys.executable, "-m", "paddle_cp.tools.elastic", "--master", master, "--job_id", job_id, "--nnodes",
           nnodes, "--nproc_per_node", str(nproc), "--log_dir", str(log_dir), "--max_restart", str(max_restart)]
    if elastic_timeout is not None:
        cmd += ["--elastic_timeout", str(elastic_timeout)]
    return cmd + [str(script), *map(str, argv)]


def progress(message, script=None):
    """A progress line under the name of the tool: `script`'s, else the running script's (a launched rank runs
    the tool's own file); on rank 0, `launch` echoes it while the ranks run."""
    print(f"{PROGRESS}{tool_name(script)}] {message}", file=sys.stderr, flush=True)


def tool_name(script=None):
    """'bench', 'selftest', 'bench-pp', 'memory-experts': `script` (by default the running one, which is pytest's
    where a test calls `launch`), as its pcp-* command is spelt: a part of a tool's folder under its folder's name
    (bench/pp.py: 'bench-pp'; bench/cli.py and bench/__main__.py: 'bench')."""
    path = Path(script or sys.argv[0])
    if path.stem.startswith("pcp-"):
        return path.stem.removeprefix("pcp-")
    stem = path.stem
    if path.parent.parent.name == "tools":
        stem = path.parent.name if stem in ("cli", "__main__") else f"{path.parent.name}_{stem}"
    return stem.replace("_", "-")


# ---- the launching side -----------------------------------------------------------

def launch(args, argv, script):
    """Run `script argv` on args.nproc ranks; return rank 0's measurements (JSON in --result-file)."""
    with tempfile.TemporaryDirectory(prefix="pcp_launch_") as tmp:
        result, log_dir = Path(tmp) / "result.json", Path(tmp) / "log"
        env = dict(os.environ, **{name: "1" for name in THREAD_VARS})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        env.pop("CUDA_VISIBLE_DEVICES", None)
        cmd = command(args.nproc, Path(script).resolve(), [*argv, "--result-file", result], log_dir)

        def run():
            progress(f"launching {args.nproc} CPU ranks", script)
            with open(Path(tmp) / "launch.out", "w+") as out:
                proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
                _follow(proc, log_dir / "workerlog.0")
                out.seek(0)
                return proc.returncode, out.read()

        returncode, launcher_output = retrying_an_abort(run, Path(script).name, fresh=[log_dir])
        if returncode != 0 or not result.exists():
            logs = "".join(f"\n----- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(log_dir.glob("workerlog.*")))
            sys.exit(f"pcp-{tool_name(script)}: launch failed (exit {returncode}){logs}\n{launcher_output[-2000:]}")
        return json.loads(result.read_text())


def tool_main(argv, parse_args, on_ranks, summarise, table, script):
    """A launched tool's main(): outside a launch, `script` on args.nproc CPU ranks, then rank 0's result summarised
    (`summarise(args, result)`) and shown as `table`; on a rank, `on_ranks(args)` measures and the rank returning
    a result writes it to --result-file."""
    from .text import show

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" not in os.environ:
        result = summarise(args, launch(args, argv, script))
        show(table(result), result, args.json)
        return
    measured = on_ranks(args)
    if measured is not None:
        Path(args.result_file).write_text(json.dumps(measured))


def _follow(proc, log):
    """Echo rank 0's progress lines until the launch ends."""
    seen = 0
    while True:
        running = proc.poll() is None
        text = log.read_text(errors="replace") if log.exists() else ""
        complete = text[:text.rfind("\n") + 1]
        for line in complete[seen:].splitlines():
            if line.startswith(PROGRESS):
                print(line, file=sys.stderr, flush=True)
        seen = len(complete)
        if not running:
            return
        time.sleep(0.5)
