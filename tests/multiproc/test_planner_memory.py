"""pcp-plan's per-rank memory estimate against pcp-memory's measurement of the layouts it plans, on one launch of
4 CPU ranks: data parallel with sharding level 3 over dp, sharding level 3 over sep (the embedding, one whole
parameter, outweighs a quarter of the rest), tensor + sequence parallel, a 1F1B pipeline, full recomputation; each
beside ring attention, run with the config pcp-plan writes. Then the long-sequence terms, each on its own launch of 2
ranks with a model where it shows: SequenceTiled MLPs (what they take off the peak) and OffloadRecomputeInputs (what
leaves the device, what the host holds). And a vision-language step on a video (pcp-memory --vision-language), its
vision tower whole and split."""
import json
import sys
from pathlib import Path

import pytest
from launcher import run_tool
from test_long_context import PEAK_FACTOR, needs_paddleformers

TOOLS = Path(__file__).resolve().parents[2] / "tools"
LAYOUTS = ("dp2 ring2 l3@dp", "ring4 l3", "tp2 ring2", "pp2 ring2 m2", "ring4 full")


def _layouts(tmp_path, layouts, seq, model):
    out = tmp_path / "layouts.json"
    cmd = [sys.executable, str(TOOLS / "bench_memory.py"), "--layouts", *layouts, "--seq", str(seq), *model,
           "--json", str(out)]
    proc = run_tool(cmd, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(layouts)
    for name, row in rows.items():
        assert 1 / PEAK_FACTOR < row["ratio"]["peak"] < PEAK_FACTOR, (name, row)
    return rows


@needs_paddleformers
def test_estimates_match_measured_memory_of_planned_layouts(tmp_path):
    rows = _layouts(tmp_path, LAYOUTS, 256, ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                                             "--intermediate", "64", "--vocab", "512"])
    for name, row in rows.items():
        for part in ("params", "optimizer"):  # owners balanced greedily over the whole model: within 2.4%
            assert abs(row["ratio"][part] - 1) < 0.03, (name, part, row)
    sharded, replicated = rows["dp2 ring2 l3@dp"], rows["ring4 full"]
    assert sharded["params"] < 0.6 * replicated["params"]  # level 3 over dp2: about half the weights
    assert rows["pp2 ring2 m2"]["activations"] is None  # a pipeline's forward and backward run in one call
    assert replicated["activations"] < 0.2 * sharded["activations"]  # recomputation keeps each layer's input


def _drop(rows, before, after, part="peak"):
    """(measured, estimated) bytes `after` holds less than `before`."""
    return rows[before][part] - rows[after][part], rows[before]["estimate"][part] - rows[after]["estimate"][part]


@needs_paddleformers
def test_tiled_mlp_removes_its_intermediates_from_the_peak_as_estimated(tmp_path):
    """2 ring ranks, 512 tokens each, an MLP 32x the hidden size: tiles of 64 tokens (8 tiles) take at least 7/8 of
    the MLP's [tokens, intermediate] tensors off the peak, without and with full recomputation, as estimated."""
    model = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "2048",
             "--vocab", "256"]
    rows = _layouts(tmp_path, ("ring2", "ring2 tile64", "ring2 full", "ring2 full tile64"), 1024, model)
    mlp_tensors = 4 * 512 * 2048 * 4  # gate, up, activation, product of one layer, fp32
    for before, after, layers in (("ring2", "ring2 tile64", 2), ("ring2 full", "ring2 full tile64", 1)):
        measured, estimated = _drop(rows, before, after)
        assert measured >= 7 / 8 * layers * mlp_tensors, (before, measured)
        assert 1 / PEAK_FACTOR < estimated / measured < PEAK_FACTOR, (before, measured, estimated)


@needs_paddleformers
def test_offload_removes_saved_layer_inputs_from_the_device_as_estimated(tmp_path):
    """2 ring ranks, 512 tokens each, 32 fully recomputed layers (short enough that the CPU attention kernel's
    [q, k] blocks stay small): offloading their inputs takes them off the device at the end of the forward and
    off the peak, as estimated; the host holds what the estimate says."""
    model = ["--hidden", "64", "--layers", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "32",
             "--vocab", "256"]
    rows = _layouts(tmp_path, ("ring2 full", "ring2 full offload"), 1024, model)
    inputs = 32 * (512 * 64 * 4 + 512 * 2 * 32 * 4)  # hidden states and rotary tables of every layer, fp32
    held, _ = _drop(rows, "ring2 full", "ring2 full offload", "activations")
    assert held == pytest.approx(inputs, rel=0.02)
    offloaded = rows["ring2 full offload"]
    assert offloaded["host"] == pytest.approx(inputs, rel=0.02) == offloaded["estimate"]["host"]
    measured, _ = _drop(rows, "ring2 full", "ring2 full offload")
    assert measured > 0.5 * inputs, measured
    # both measured peaks are in a layer's backward (the one phase offload changes); the estimate's own peak
    # moves to the optimizer step, its layer backward being ~3 MiB under the measured one in both layouts (the
    # CPU attention kernel's [q, k] blocks, which GPU flash attention does not hold): compared phase by phase
    from paddle_cp.cost.memory import memory
    from paddle_cp.cost.model_shape import ModelShape
    from paddle_cp.cost.candidate import Layout

    shape = ModelShape(layers=32, hidden=64, heads=2, kv_heads=1, vocab=256, intermediate=32, tied_embeddings=True)
    phase = {name: memory(shape, Layout.parse(name), 1024, 1, 4)["phases"]["layer_backward"]
             for name in ("ring2 full", "ring2 full offload")}
    estimated = phase["ring2 full"] - phase["ring2 full offload"]
    assert 1 / PEAK_FACTOR < estimated / measured < PEAK_FACTOR, (measured, estimated)


@needs_paddleformers
def test_host_optimizer_moves_the_optimizer_state_off_the_device_as_estimated(tmp_path):
    """2 ring ranks, a model whose AdamW state outweighs its activations (hidden 256, 128 tokens): dp_config
    offload_optimizer takes the state off the device (allocator: nothing left for it; the peak drops by it) and
    the host holds it, replicated and at sharding level 3 (this rank's share), as estimated."""
    model = ["--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "1024",
             "--vocab", "4096"]
    rows = _layouts(tmp_path, ("ring2", "ring2 host-optimizer", "ring2 l3", "ring2 l3 host-optimizer"), 128, model)
    for before in ("ring2", "ring2 l3"):
        after = rows[f"{before} host-optimizer"]
        assert after["optimizer"] < 0.01 * rows[before]["optimizer"], after
        assert after["host"] == pytest.approx(rows[before]["optimizer"], rel=0.01)
        assert 1 / PEAK_FACTOR < after["ratio"]["host"] < PEAK_FACTOR, after
        measured, estimated = _drop(rows, before, f"{before} host-optimizer")
        assert measured > 0.9 * rows[before]["optimizer"], (before, measured)
        assert 1 / PEAK_FACTOR < estimated / measured < PEAK_FACTOR, (before, measured, estimated)
    assert rows["ring2 l3 host-optimizer"]["host"] < 0.55 * rows["ring2 host-optimizer"]["host"]  # a share


@needs_paddleformers
def test_vision_language_step_memory_matches_the_estimate_whole_and_split(tmp_path):
    """2 CPU ranks, a small Qwen2.5-VL (PaddleFormers' own, eager attention in its tower) on a video of 8 frames at
    64 x 64 (4 temporal patches of 16 x 16 patches), its tower whole and split by ContextParallel: the tower's held
    bytes as the inventory counts them (whole: to the byte), the step's peak as estimated, and the split's tower
    holding half the whole one's (2 of the 4 pieces)."""
    out = tmp_path / "vision_language.json"
    cmd = [sys.executable, str(TOOLS / "bench_memory.py"), "--vision-language", "--nproc", "2", "--frames", "8",
           "--json", str(out)]
    proc = run_tool(cmd, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"whole", "split"}
    assert rows["whole"]["estimate"]["vision"] == rows["whole"]["vision"]
    for mode, row in rows.items():
        assert abs(row["ratio"]["vision"] - 1) < 0.01, (mode, row)
        for part in ("params", "optimizer"):
            assert abs(row["ratio"][part] - 1) < 0.01, (mode, part, row)
        assert 1 / PEAK_FACTOR < row["ratio"]["peak"] < PEAK_FACTOR, (mode, row)
    assert rows["split"]["vision"] < 0.55 * rows["whole"]["vision"]
    assert rows["split"]["peak"] < rows["whole"]["peak"]
