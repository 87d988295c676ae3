"""The complete script of docs/packed_documents.md runs as written on 2 CPU ranks (one launch,
tests/workers/docs_script.py): every loss it logs equals one card's on the same batches, and its check_parity
finds every output within 1e-5."""
import pytest
from launcher import ROOT, launch_once


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("paddleformers")
    return launch_once("docs_script.py", 2, str(ROOT / "docs" / "packed_documents.md"))


def test_packed_documents_script_logs_one_cards_loss(reports):
    assert not any(report["values"].get("crash") for report in reports)
    assert len(reports[0]["values"]["logged"]) == 3 and reports[0]["max_abs"]["script.loss"] <= 1e-5
    assert reports[1]["values"]["logged"] == []  # rank 0 logs, once per step


def test_packed_documents_script_proves_its_run(reports):
    for report in reports:
        printed = report["values"]["printed"]
        assert "equal to one card within 1e-05" in printed and "loss:" in printed, printed
