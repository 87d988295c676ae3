"""Run a worker script under `paddle.distributed.launch` on CPU ranks and collect each rank's JSON report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
EXAMPLES = ROOT / "examples"


def launch(worker, nproc, *args, timeout=600):
    """Run tests/workers/<worker> on `nproc` gloo ranks; return the per-rank reports (rank order)."""
    with tempfile.TemporaryDirectory(prefix="pcp_launch_") as tmp:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKERS), str(EXAMPLES), env.get("PYTHONPATH", "")])
        env["PCP_REPORT_DIR"] = tmp
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("CUDA_VISIBLE_DEVICES", None)
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
               "--log_dir", os.path.join(tmp, "log"), str(WORKERS / worker), *map(str, args)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        reports = []
        for rank in range(nproc):
            path = Path(tmp) / f"rank{rank}.json"
            if path.exists():
                reports.append(json.loads(path.read_text()))
        if proc.returncode != 0 or len(reports) != nproc:
            logs = ""
            for log in sorted(Path(tmp, "log").glob("workerlog.*")):
                logs += f"\n----- {log.name}\n" + log.read_text()[-4000:]
            raise AssertionError(f"launch of {worker} on {nproc} ranks failed (exit {proc.returncode})"
                                 f"\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}{logs}")
        return reports
