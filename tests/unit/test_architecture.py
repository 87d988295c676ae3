"""The package's import structure, from the AST of every module of paddle_cp (imports at module level and inside
functions alike): (a) no import cycle between modules at module level, (b) every room imports only from rooms
below it in the order docs/architecture.md states (read from the doc, so the two cannot drift), (c) the core
rooms import nothing from integrations/."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "paddle_cp"
ABOVE_THE_CORE = {"integrations/", "train.py", "tools/"}  # the rooms that may use integrations/


def _modules():
    """{dotted name: (path, is a package)} of every module of paddle_cp."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


MODULES = _modules()


def _known_module(name):
    """`name`, or the closest enclosing module that exists (a name imported from a module is that module)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(importer, package, node):
    """The paddle_cp modules an Import/ImportFrom node of `importer` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = importer.split(".") if package else importer.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix for alias in node.names]
    return {_known_module(name) for name in names if name == "paddle_cp" or name.startswith("paddle_cp.")}


class _Imports(ast.NodeVisitor):
    """Every paddle_cp module a module imports: (imported, at module level rather than inside a function)."""

    def __init__(self, importer, package):
        self.importer, self.package, self.found, self._depth = importer, package, set(), 0

    def _function(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _import(self, node):
        self.found |= {(target, self._depth == 0) for target in _targets(self.importer, self.package, node)}

    visit_Import = visit_ImportFrom = _import


def _imports():
    """{(importer, imported): at module level} over the whole package, self-imports left out."""
    edges = {}
    for name, (path, package) in MODULES.items():
        visitor = _Imports(name, package)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for target, module_level in visitor.found:
            if target != name:
                edges[name, target] = edges.get((name, target), False) or module_level
    return edges


def room(module):
    """The room of a dotted module name: 'cost/', 'dtypes.py', or '__init__.py' for the package's public names."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def documented_order():
    """{room: its line in docs/architecture.md's order, 0 the lowest}: the numbered list under the heading that says
    what may import what, each line's rooms in backticks before its dash."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## What may import what"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    order = {}
    for line, rooms in enumerate(re.findall(r"^\d+\. (.+?) —", section, flags=re.M)):
        for name in re.findall(r"`([^`]+)`", rooms):
            assert name not in order, f"docs/architecture.md lists {name} twice in its order"
            order[name] = line
    return order


def _cycles(edges):
    """The strongly connected components of more than one module of the graph (Tarjan's algorithm)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _violations(edges, order):
    """{(importer, imported)} that import upwards, sideways on one line of the order, or into integrations/ from
    the core."""
    bad = set()
    for a, b in edges:
        ra, rb = room(a), room(b)
        if ra != rb and (order[ra] <= order[rb] or (rb == "integrations/" and ra not in ABOVE_THE_CORE)):
            bad.add((a, b))
    return bad


EDGES = _imports()
ORDER = documented_order()


def test_every_room_is_placed_in_the_documented_order():
    rooms = {room(module) for module in MODULES}
    assert rooms <= set(ORDER), f"docs/architecture.md's order misses {sorted(rooms - set(ORDER))}"
    assert set(ORDER) <= rooms, f"docs/architecture.md's order names rooms that do not exist: {sorted(set(ORDER) - rooms)}"
    assert ABOVE_THE_CORE <= set(ORDER)


def test_no_import_cycle_at_module_level():
    module_level = {edge for edge, top in EDGES.items() if top}
    assert _cycles(module_level) == []


def test_rooms_import_only_downwards_and_the_core_nothing_from_integrations():
    assert _violations(EDGES, ORDER) == set()


def test_the_checks_see_what_they_check():
    """The reader finds imports of every form (relative, from a package, inside functions) and the checks fire."""
    assert EDGES[("paddle_cp.comm.counters", "paddle_cp.runtime")]  # `from .. import runtime`
    assert ("paddle_cp.tools.bench.cli", "paddle_cp.attention.layout.sequence_layout") in EDGES  # inside a function
    assert not EDGES[("paddle_cp.tools.bench.cli", "paddle_cp.attention.layout.sequence_layout")]
    assert _cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert _violations({("paddle_cp.comm.p2p", "paddle_cp.attention.kernels")}, ORDER)  # upwards
    a, b = next((a, b) for a in ORDER for b in ORDER if a != b and ORDER[a] == ORDER[b] and a.endswith("/")
                and b.endswith("/"))
    assert _violations({(f"paddle_cp.{a[:-1]}.x", f"paddle_cp.{b[:-1]}.y")}, ORDER)  # sideways on one line
    assert _violations({("paddle_cp.plans.base", "paddle_cp.integrations.paddleformers.plans")}, ORDER)
    assert not _violations({("paddle_cp.plans.base", "paddle_cp.comm.p2p")}, ORDER)
