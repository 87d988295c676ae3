"""The complete scripts of docs/packed_documents.md and docs/vision_language.md run as written on 2 CPU ranks (one
launch, tests/workers/docs_script.py): every loss each logs equals one card's on the same batches, and its
check_parity finds every output within 1e-5."""
import pytest
from launcher import ROOT, launch_once

PAGES = ("packed_documents", "vision_language")


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("paddleformers")
    return launch_once("docs_script.py", 2, *(str(ROOT / "docs" / f"{page}.md") for page in PAGES))


@pytest.mark.parametrize("page", PAGES)
def test_docs_script_logs_one_cards_loss(reports, page):
    assert not any(report["values"].get("crash") for report in reports), reports[0]["values"].get("crash")
    assert len(reports[0]["values"][f"{page}.logged"]) == 3 and reports[0]["max_abs"][f"{page}.loss"] <= 1e-5
    assert reports[1]["values"][f"{page}.logged"] == []  # rank 0 logs, once per step


@pytest.mark.parametrize("page", PAGES)
def test_docs_script_proves_its_run(reports, page):
    for report in reports:
        printed = report["values"][f"{page}.printed"]
        assert "equal to one card within 1e-05" in printed and "loss:" in printed, printed
