"""The planner's host optimizer (dp_config offload_optimizer): its step-time term, where the search proposes it,
host memory per node, and `pcp-plan --max-seq` for Llama-3-8B on 8 x 80 GB with PaddleFormers' Llama as it runs
on a GPU (fused RMSNorm, eager fp32 RoPE)."""
import json

import pytest
import yaml

from paddle_cp.api.config import load_config
from paddle_cp.cost import search
from paddle_cp.tools.plan import cli as plan
from paddle_cp.cost.memory import FP32, MOMENTS_BYTES, memory, recompute_inputs
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.cost.candidate import Cluster, Layout
from paddle_cp.cost.step_time import step_time

LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
MODEL = ModelShape.from_config(LLAMA3_8B)
CLUSTER = Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, 300e12)  # pcp-plan's defaults
GPU_NORM = ("rms_norm",)  # PaddleFormers 1.2.0's Llama on GPU: fused_rms_norm_ext, eager RoPE
GRANULARITY = 65536


def test_host_step_is_gradients_out_adamw_on_the_host_and_values_back():
    layout = Layout(ring=8, sharding=3, recompute="full", offload_optimizer=True)
    times = step_time(MODEL, layout, CLUSTER, 1 << 20, 1, 2)
    # level 3 over 8 ranks: an eighth of the (untied) model each, more than the largest parameter
    stepped = MODEL.params / 8
    assert stepped > MODEL.largest_param
    # bf16: the gradient out and the new value back in fp32 (cast on the device), 4 bytes each
    expected = 2 * stepped * 4 / CLUSTER.pcie_bandwidth + stepped / CLUSTER.host_adamw_rate
    assert times["host_optimizer"] == pytest.approx(expected)
    on_device = step_time(MODEL, Layout(ring=8, sharding=3, recompute="full"), CLUSTER, 1 << 20, 1, 2)
    assert on_device["host_optimizer"] == 0
    assert {**times, "host_optimizer": 0.0} == on_device  # nothing else changes
    # unsharded, every rank steps every parameter; a faster host halves the AdamW part
    whole = step_time(MODEL, Layout(ring=8, offload_optimizer=True), CLUSTER, 1 << 20, 1, 2)["host_optimizer"]
    assert whole == pytest.approx(8 * expected)
    # fp32: no master on the host, so the value goes out beside the gradient (4 + 4 bytes out, 4 back)
    fp32 = step_time(MODEL, layout, CLUSTER, 1 << 20, 1, 4)["host_optimizer"]
    assert fp32 == pytest.approx(3 * stepped * 4 / CLUSTER.pcie_bandwidth + stepped / CLUSTER.host_adamw_rate)
    fast = Cluster(**{**vars(CLUSTER), "host_adamw_rate": 2 * CLUSTER.host_adamw_rate})
    fast_time = step_time(MODEL, layout, fast, 1 << 20, 1, 2)["host_optimizer"]
    assert fast_time == pytest.approx(expected - stepped / CLUSTER.host_adamw_rate / 2)


def test_host_memory_per_node_holds_the_optimizer_and_host_memory_gb_limits_it():
    layout = Layout(ring=8, sharding=3, recompute="full", mlp_tile=4096, offload=True, offload_optimizer=True,
                    loss_chunk=4096)
    seq = 3_800 * 1024
    found = search.estimate(MODEL, layout, CLUSTER, seq, fused=GPU_NORM)
    inputs = MODEL.layers * recompute_inputs(MODEL, layout, seq / 8, 2)
    optimizer = MODEL.params / 8 * (MOMENTS_BYTES + FP32)  # two fp32 moments and an fp32 copy
    assert found["host_per_node"] == pytest.approx(8 * (inputs + optimizer))
    assert found["memory"]["optimizer"] == 0
    small = Cluster(**{**vars(CLUSTER), "host_memory": found["host_per_node"] - 1e9})
    assert found["fits"] and not search.estimate(MODEL, layout, small, seq, fused=GPU_NORM)["fits"]


def test_candidates_include_the_host_optimizer_at_every_level_and_rank_it_last():
    found = list(search.candidates(MODEL, 8, 1 << 20, 8))
    assert {c.sharding for c in found if c.offload_optimizer} == {0, 1, 2, 3}
    assert not any(c.offload_optimizer for c in search.candidates(MODEL, 8, 1 << 20, 8, offload_optimizer=False))

    def chosen(seq):
        ranked = search.rank_layouts(MODEL, CLUSTER, seq, fused=GPU_NORM)
        return ranked, [e for e in ranked if e["fits"]]

    # short: nothing saves memory; 3.0M: tiles and offload fit without the host optimizer; 3.8M: only with it
    for seq, host, savers in ((1 << 17, False, False), (3_000 * 1024, False, True), (3_800 * 1024, True, True)):
        ranked, fitting = chosen(seq)
        assert fitting
        # kept only where nothing fits without it (then the layouts that do not fit stay, ranked below)
        assert all(e["layout"]["offload_optimizer"] == host for e in (fitting if host else ranked)), seq
        assert bool(fitting[0]["layout"]["offload"]) == savers, seq
    without = search.rank_layouts(MODEL, CLUSTER, 3_800 * 1024, fused=GPU_NORM, offload_optimizer=False)
    assert not without[0]["fits"]


def _max_seq(tmp_path, *flags):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    out = tmp_path / "plan.json"
    plan.main(["--config", str(tmp_path / "config.json"), "--max-seq", "--devices", "8", "--memory-gb", "80",
               "--json", str(out), *flags])
    return json.loads(out.read_text())


def test_max_seq_for_paddleformers_llama_on_gpu_passes_alst_with_the_host_optimizer(tmp_path, capsys):
    """ALST: 3.7M tokens (the issue: 3.8M) for Llama-3-8B on 8 x H100 80 GB, optimizer states on the host."""
    result = _max_seq(tmp_path)  # --kernels fused-norm, the default
    assert "longest sequence that fits" in capsys.readouterr().out
    seq, best = result["seq"], result["best"]
    assert seq >= 3_800_000 and seq % GRANULARITY == 0
    layout = Layout.parse(best["name"])
    assert Layout(**best["layout"]) == layout and "host-optimizer" in best["name"]
    assert layout.offload_optimizer and layout.offload and layout.mlp_tile and layout.recompute == "full"
    # the answer is the planner's own breakdown: this layout fits at seq (80 GB less the reserve), not one step
    # longer, and nothing does
    usable = CLUSTER.usable_memory
    assert memory(MODEL, layout, seq, fused=GPU_NORM)["peak"] <= usable < memory(MODEL, layout, seq + GRANULARITY,
                                                                                 fused=GPU_NORM)["peak"]
    assert best["host_per_node"] <= 2000e9
    assert not search.rank_layouts(MODEL, CLUSTER, seq + GRANULARITY, fused=GPU_NORM)[0]["fits"]
    # what runs it: dp_config turns the host optimizer on, the Trainer's flags and the fused norm are listed
    chosen = result["plans"][0]
    assert chosen["config"]["dp_config"] == {"sharding_level": 3, "offload_optimizer": True}
    assert yaml.safe_load(chosen["yaml"]) == chosen["config"]
    assert chosen["training_arguments"] == {"offload_recompute_inputs": True, "mlp_tile_tokens": 4096,
                                            "tensorwise_offload_optimizer": True}
    assert chosen["model_config"]["fuse_rms_norm"] is True and "NOTE" not in chosen["yaml"]
    path = tmp_path / "layout.yaml"
    path.write_text(chosen["yaml"])
    _, config = load_config(str(path), world_size=8)
    assert config["dp_config"]["offload_optimizer"] is True
    # without the host optimizer the same search stops shorter, and so it does with less host memory per node;
    # eager ops (CPU) shorter still
    assert _max_seq(tmp_path, "--no-host-optimizer")["seq"] < seq
    host_bound = _max_seq(tmp_path, "--host-memory-gb", "1200")
    assert host_bound["seq"] < seq and host_bound["best"]["host_per_node"] <= 1200e9 < best["host_per_node"]
    eager = _max_seq(tmp_path, "--kernels", "eager")
    assert eager["seq"] < seq and not eager["plans"][0]["model_config"].get("fuse_rms_norm")


def test_fused_rope_plans_say_the_llama_does_not_call_it(tmp_path, capsys):
    result = _max_seq(tmp_path, "--kernels", "fused")
    assert "NOTE: the estimate assumes a fused rotary kernel" in result["plans"][0]["yaml"]
    assert result["plans"][0]["model_config"]["fuse_rms_norm"] is True
