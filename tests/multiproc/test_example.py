"""The examples run as documented (one launch of 4 ranks, tests/workers/examples_run.py): every YAML in
examples/configs with train_llama_cp.py, and the README's main job, train_long_context.py, including a
resume by default from its checkpoint; each matches its one-process replay."""
import csv
import importlib.util

import pytest
from launcher import EXAMPLES, launch_once


@pytest.fixture(scope="module")
def rank0(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    reports = launch_once("examples_run.py", 4, str(out))
    assert "crash" not in reports[0]["values"], reports[0]["values"].get("crash")
    return reports[0]["values"], out


@pytest.mark.parametrize("config", sorted(path.name for path in (EXAMPLES / "configs").glob("*.yaml")))
def test_every_yaml_config_trains_like_one_process(rank0, config):
    values, _ = rank0
    run = values[f"config.{config}"]
    assert len(run["losses"]) == 2
    assert run["gap"] < 1e-5


def test_main_job_resumes_and_matches_its_one_process_replay(rank0):
    values, out = rank0
    first, resumed = values["long_context.first"], values["long_context.resumed"]
    assert len(first["losses"]) == 3 and len(resumed["losses"]) == 4
    # the same command, run again for 4 steps, resumes from the first run's last checkpoint (after step 3): it
    # carries its losses, then trains step 4
    assert resumed["losses"][:3] == first["losses"]
    assert resumed["gap"] < 1e-5 and first["gap"] < 1e-5
    for run in (first, resumed):  # printed once per run: the chosen layout's predicted GPU ms, and the chunks'
        balance = run["balance"]
        assert balance["documents"] >= 1.0 and balance["chunks"] >= 1.0, balance
        assert 0 < balance["gpu_ms"]["chosen"] <= 1.01 * balance["gpu_ms"]["chunks"], balance
    assert resumed["losses"][-1] < resumed["losses"][0] - 0.3  # it learns
    with open(out / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(row["loss"]) for row in rows] == pytest.approx(resumed["losses"], abs=1e-7)
    assert [float(row["one_process_loss"]) for row in rows] == pytest.approx(resumed["reference"], abs=1e-7)
    if importlib.util.find_spec("matplotlib"):  # the optional `examples` extra
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
