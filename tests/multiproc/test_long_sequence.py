"""SequenceTiled MLPs and OffloadRecomputeInputs on PaddleFormers' Llama train like one card with neither (3 AdamW
steps, fp32, 1e-5 on losses, first-step gradients and parameters; full_state_dict under pipelines and sharding), on
ring, Ulysses and hybrid, without and with recomputation, under a pipeline and at sharding levels 1-3; bad settings
fail on every rank. One launch per world size: 2 ranks for the backends and the level-3 case, 4 for the backends
and the composed layouts."""
import pytest
from launcher import launch_once
from test_context_parallel import assert_close
from test_long_context import needs_paddleformers

GROUPS = {2: ("sep", "level3"), 4: ("sep", "composed")}  # the worker's groups, by world size


def _reports(world):
    return launch_once("long_sequence_parity.py", world, *GROUPS[world])


@needs_paddleformers
@pytest.mark.parametrize("world", [2, 4])
def test_tiled_and_offloaded_llama_trains_like_one_card_on_every_backend(world):
    reports = _reports(world)
    assert_close(reports)
    runs = reports[0]["values"]["runs"]
    assert {run.split(".")[0] for run in runs} == ({"p2p", "all2all", "hybrid"} if world == 4 else {"p2p", "all2all"})
    for report in reports:
        values = report["values"]
        for run in runs:
            assert {f"{run}.{kind}" for kind in ("loss", "grad", "param")} <= set(report["max_abs"])
            tiles = -(-values[f"{run}.local_rows"] // 4)  # the rank's rows (2 sequences) in tiles of 4
            assert tiles >= 3
            # per step (3), the first MLP's forward runs every tile and its backward replays each; under full
            # recomputation the layer's first forward records no graph, so the MLP runs once, whole
            recompute = ".recompute" in run
            calls = 2 if run.endswith("offload_only") else (3 if recompute else 2) * tiles
            assert values[f"{run}.mlp_calls"] == 3 * calls, (run, values[f"{run}.mlp_calls"])
            if ".offload" in run:  # 2 layers x (hidden states, cos, sin) per step, each back once; none left
                moved = values[f"{run}.offload"]
                assert moved["offloaded"] == moved["restored"] == 3 * 2 * 3, (run, moved)
                assert moved["prefetched"] == 3 * 3 and moved["fetched_on_demand"] == 3 * 3, (run, moved)
                assert moved["host_bytes_after"] == 0 and moved["host_peak"] > 0
        for name in ("zero", "negative", "bool", "float"):
            kind, message = report["errors"][f"bad.{name}"]
            assert kind == "ValueError" and "positive number of tokens" in message, (name, message)
        for name, words in (("no_layer", "name the layers it applies to"), ("attention", "mixes tokens"),
                            ("decoder_layer", "key its MLP"), ("parameter", "key it by the layer's name"),
                            ("offload_without_recompute", "does not recompute whole layers"),
                            ("offload_unrecomputed_forward", "ran its forward without recomputation")):
            kind, message = report["errors"][f"bad.{name}"]
            assert kind == "ValueError" and words in message, (name, message)


@needs_paddleformers
def test_tiled_and_offloaded_llama_under_pipeline_recompute_and_sharding_levels():
    reports = _reports(4)
    assert_close(reports)
    keys = set(reports[0]["max_abs"])
    for name in ("pp2_sep2_recompute_reentrant_offload", "pp2_sep2_recompute_plain", "dp2_sep2_l1", "dp2_sep2_l2",
                 "dp2_sep2_l3"):
        assert any(key.startswith(f"{name}.state.") for key in keys), name
    for report in reports:
        values = report["values"]
        assert values["pp2_sep2_recompute_reentrant_offload.recompute_calls"] > 0
        assert values["pp2_sep2_recompute_reentrant_offload.offloaded"] > 0  # this stage's layers' inputs
        for level in (1, 2, 3):  # 4 layers x (hidden states, the eager build's float causal mask, cos, sin) x 3 steps
            assert values[f"dp2_sep2_l{level}.offloaded"] == 4 * 4 * 3, (level, values[f"dp2_sep2_l{level}.offloaded"])


@needs_paddleformers
def test_tiled_mlp_at_sharding_level_3_fetches_its_weights_once_per_pass_at_uneven_lengths():
    """65 tokens over a ring of 2 leave the ranks 33 and 32 tokens (x2 sequences), so 17 and 16 tiles of 4: the
    level-3 fetches (broadcasts over sep) must not follow the tiles, or the ranks' broadcasts fall out of step."""
    reports = _reports(2)
    assert_close(reports)
    rows = sorted(report["values"]["l3.plain.local_rows"] for report in reports)
    assert rows == [64, 66], rows
    for report in reports:
        values = report["values"]
        tiles = -(-values["l3.plain.local_rows"] // 4)
        for run, passes in (("plain", 2), ("recompute", 3)):
            assert {f"l3.{run}.{kind}" for kind in ("loss", "grad", "param")} <= set(report["max_abs"])
            assert values[f"l3.{run}.grads_compared"] > 0
            # per step (3) every pass over the MLP runs each tile: its forward and backward, and under recomputation
            # the layer's first forward (no graph) too; each pass fetches the weights once
            assert values[f"l3.{run}.mlp_calls"] == 3 * passes * tiles, (run, values[f"l3.{run}.mlp_calls"])
            fetches = values[f"l3.{run}.fetches"]
            assert set(fetches) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}, fetches
            assert all(count == 3 * passes for count in fetches.values()), (run, fetches)
            assert values[f"l3.{run}.mlp_reduced_in_backward"] is True
