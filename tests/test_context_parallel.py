"""Multi-rank context parallelism on CPU gloo ranks vs a single-process reference (fp32, 1e-5)."""
import pytest
from launcher import launch

TOL = 1e-5
EXPECTED_ERRORS = {  # check -> what the message must name
    "unknown_backend": "use one of",
    "context_backend": "use one of",
    "mesh_without_sep": "dim_names",
    "p2p_length": "pad the sequence to a multiple of",
    "dropout": "dropout to 0",
    "shapes": "shapes disagree",
    "ulysses_heads": "divides the head count",
    "all2all_length": "pad the sequence to a multiple of",
}


def assert_close(reports):
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        assert report["max_abs"], "the worker compared nothing"
        worst = {name: err for name, err in report["max_abs"].items() if not err <= TOL}
        assert not worst, f"rank {report['rank']} beyond {TOL}: {worst}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_attention_matches_single_process(world):
    reports = launch("attention_parity.py", world)
    assert_close(reports)
    for report in reports:
        # 5 functional cases x (out, dq, dk, dv) + the SDPA-layer plan for both backends
        assert len(report["max_abs"]) == 22
        assert report["values"]["layer.p2p.sdpa_restored"] and report["values"]["layer.all2all.sdpa_restored"]
        for check, error in report["errors"].items():
            assert error[0] == "ValueError", (check, error)
            assert EXPECTED_ERRORS[check] in error[1], (check, error)
        expected_checks = set(EXPECTED_ERRORS) if world > 1 else set(EXPECTED_ERRORS) - {"ulysses_heads", "all2all_length"}
        assert set(report["errors"]) == expected_checks
        if world > 1:
            assert report["values"]["bytes"]["ring"] > 0 and report["values"]["bytes"]["ulysses"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_llama_training_matches_single_process(world):
    sources = ["tiny"]
    try:
        import paddleformers  # noqa: F401

        sources.append("paddleformers")
    except ImportError:
        pass
    reports = launch("model_parity.py", world, *sources)
    assert_close(reports)
    for source in sources:
        for backend in ("p2p", "all2all"):
            assert {f"{source}.{backend}.{kind}" for kind in ("loss", "grad", "param")} <= set(reports[0]["max_abs"])
            losses = reports[0]["values"][f"{source}.{backend}.losses"]
            assert losses[-1] < losses[0], "training should reduce the loss"
