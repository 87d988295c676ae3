"""pcp-plan's per-rank memory estimate against pcp-memory's measurement of the layouts it plans, on one launch of
4 CPU ranks: data parallel with sharding level 3 over dp, sharding level 3 over sep (the embedding, one whole
parameter, outweighs a quarter of the rest), tensor + sequence parallel, a 1F1B pipeline, full recomputation; each
beside ring attention, run with the config pcp-plan writes."""
import json
import subprocess
import sys
from pathlib import Path

from test_long_context import PEAK_FACTOR, needs_paddleformers

TOOLS = Path(__file__).resolve().parents[2] / "tools"
LAYOUTS = ("dp2 ring2 l3@dp", "ring4 l3", "tp2 ring2", "pp2 ring2 m2", "ring4 full")


@needs_paddleformers
def test_estimates_match_measured_memory_of_planned_layouts(tmp_path):
    out = tmp_path / "layouts.json"
    cmd = [sys.executable, str(TOOLS / "bench_memory.py"), "--layouts", *LAYOUTS, "--seq", "256", "--hidden", "32",
           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--vocab", "512",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(LAYOUTS)
    for name, row in rows.items():
        for part in ("params", "optimizer"):
            assert abs(row["ratio"][part] - 1) < 0.02, (name, part, row)
        assert 1 / PEAK_FACTOR < row["ratio"]["peak"] < PEAK_FACTOR, (name, row)
    sharded, replicated = rows["dp2 ring2 l3@dp"], rows["ring4 full"]
    assert sharded["params"] < 0.6 * replicated["params"]  # level 3 over dp2: about half the weights
    assert rows["pp2 ring2 m2"]["activations"] is None  # a pipeline's forward and backward run in one call
    assert replicated["activations"] < 0.2 * sharded["activations"]  # recomputation keeps each layer's input
