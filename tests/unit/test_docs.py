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


def _architecture_tree():
    """The module paths docs/architecture.md's tree lists under paddle_cp/ (folders by indentation)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("```\npaddle_cp/\n") + 4:]
    listed, folders = set(), []
    for line in block[:block.index("```")].splitlines()[1:]:
        indent = (len(line) - len(line.lstrip())) // 2
        if indent == 0 or indent > 10:  # another root (examples/, tests/) or a description's continuation
            folders = [] if indent == 0 else folders
            continue
        entry = line.split()[0]
        folders = folders[:indent - 1]
        if entry.endswith("/"):
            folders.append(entry.rstrip("/"))
        elif entry.endswith(".py") and (not folders or folders[0] != "examples"):
            listed.add("/".join(folders + [entry]))
    return listed


def test_architecture_tree_lists_every_module():
    modules = {str(p.relative_to(ROOT / "paddle_cp")) for p in (ROOT / "paddle_cp").rglob("*.py")}
    listed = _architecture_tree()
    assert listed <= modules, f"docs/architecture.md lists modules that do not exist: {sorted(listed - modules)}"
    unlisted = sorted(m for m in modules - listed if not m.endswith("__init__.py"))
    assert not unlisted, f"docs/architecture.md's tree misses {unlisted}"
