"""SequenceTiled on PaddleFormers' Llama MLPs trains like one card without it (3 AdamW steps, fp32, 1e-5 on losses,
first-step gradients and parameters; full_state_dict under pipelines and sharding), on ring, Ulysses and hybrid,
without and with recomputation, under a pipeline and at sharding levels 1-3; bad settings fail on every rank."""
import pytest
from launcher import launch
from test_context_parallel import assert_close
from test_long_context import needs_paddleformers


@needs_paddleformers
@pytest.mark.parametrize("world", [2, 4])
def test_tiled_mlp_trains_like_one_card_on_every_backend(world):
    reports = launch("sequence_tiled_parity.py", world, "sep")
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
            calls = 2 * tiles + (1 if run.endswith("recompute") else 0)
            assert values[f"{run}.mlp_calls"] == 3 * calls, (run, values[f"{run}.mlp_calls"])
        for name in ("zero", "negative", "bool", "float"):
            kind, message = report["errors"][f"bad.{name}"]
            assert kind == "ValueError" and "positive number of tokens" in message, (name, message)
        for name, words in (("no_layer", "name the layers it applies to"), ("attention", "mixes tokens"),
                            ("decoder_layer", "key its MLP"), ("parameter", "key it by the layer's name")):
            kind, message = report["errors"][f"bad.{name}"]
            assert kind == "ValueError" and words in message, (name, message)


@needs_paddleformers
def test_tiled_mlp_under_pipeline_recompute_and_sharding_levels():
    reports = launch("sequence_tiled_parity.py", 4, "composed")
    assert_close(reports)
    keys = set(reports[0]["max_abs"])
    for name in ("pp2_sep2_recompute_reentrant", "pp2_sep2_recompute_plain", "dp2_sep2_l1", "dp2_sep2_l2",
                 "dp2_sep2_l3"):
        assert any(key.startswith(f"{name}.state.") for key in keys), name
    assert all(report["values"]["pp2_sep2_recompute_reentrant.recompute_calls"] > 0 for report in reports)
