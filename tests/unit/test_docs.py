"""The README stays a five-minute read, its links and the docs' links lead somewhere, every docs page opens
with a runnable snippet, and CI runs exactly the README's test command."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_at_most_12_kb():
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_resolve(page):
    targets = [link.split("#")[0] for link in LINK.findall(page.read_text())
               if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    missing = [target for target in targets if not (page.parent / target).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda page: page.name)
def test_docs_page_opens_with_a_snippet(page):
    top = page.read_text().splitlines()[:15]  # the title, at most a short paragraph, then the snippet
    assert any(line.startswith("```") for line in top), f"{page.name}: open the page with a runnable snippet"


def _commands(text):
    """Shell commands with pip's `python -m`, `--quiet` and quotes taken out."""
    text = re.sub(r"python -m (pip)", r"\1", text).replace("--quiet ", "").replace('"', "")
    return {" ".join(part.split()) for line in text.splitlines() for part in line.split(" && ") if part.strip()}


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    test_block = readme.split("**Tests**")[1].split("```bash\n")[1].split("\n```")[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert _commands(test_block) <= _commands(ci), (_commands(test_block) - _commands(ci))
