"""No process state outside paddle_cp/runtime.py: a scan of every module's source (no import needed).

The rule, for each name bound at module level or in a class body of any module but runtime.py:
- immutable values pass: numbers, strings, bytes, None, tuples, frozensets, MappingProxyType, compiled
  patterns, functions, classes, dataclass fields (made per instance);
- a dict, list or set (a display, a comprehension, or dict()/list()/set()/sorted()) passes only as a constant
  table: an UPPER_CASE name that no code in the package changes (no item assignment, deletion, augmented
  assignment, or mutating method call such as append/update/setdefault/add/pop/clear naming it, bare or as an
  attribute); `__all__` passes;
- anything else that holds state fails: a lowercase name bound to a container, a weak dictionary, a counter,
  threading.local, a lock, an instance of a paddle_cp class (its attributes change; frozen dataclasses and
  NamedTuples excepted), a `global` statement,
  a functools cache.
A registry filled by calls (at import, by model libraries or by users) is state: it lives in
runtime.installed, so `runtime.reset()` decides what it keeps, and the scan sees no module-level list.
"""
import ast
import pathlib

import paddle_cp

PACKAGE = pathlib.Path(paddle_cp.__file__).parent
RUNTIME = PACKAGE / "runtime.py"
CONTAINER_FACTORIES = frozenset({"dict", "list", "set", "sorted", "defaultdict", "OrderedDict", "Counter", "deque"})
STATE_FACTORIES = frozenset({"WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local", "count", "Lock",
                             "RLock", "Event", "Condition", "Semaphore", "Queue", "SimpleQueue"})
CACHES = frozenset({"lru_cache", "cache", "cached_property"})
MUTATORS = frozenset({"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add",
                      "discard", "remove", "sort", "reverse", "__setitem__", "__delitem__"})


def _modules():
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def _called_name(call):
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _kind(value, package_classes):
    """'container' (a dict, list or set), 'state' (anything else mutable), or None (immutable)."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return "container"
    if isinstance(value, ast.Call):
        name = _called_name(value)
        if name in CONTAINER_FACTORIES:
            return "container"
        if name in STATE_FACTORIES or name in package_classes:
            return "state"
    return None


def _named(node):
    """The name a mutated expression ends in (`TABLE` or `x.TABLE`), or None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mutated_names(trees):
    """Every name some code in the package changes in place."""
    names = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Subscript):
                        names.add(_named(target.value))
                    elif isinstance(node, ast.AugAssign):
                        names.add(_named(target))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                names.add(_named(node.func.value))
    return names - {None}


def _bindings(tree):
    """(line, name, value, where) of each module-level and class-level assignment."""
    def assigned(body, where):
        for node in body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            yield node.lineno, name.id, node.value, where
            elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
                yield node.lineno, node.target.id, node.value, where
            elif isinstance(node, ast.ClassDef):
                yield from assigned(node.body, f"class {node.name}")
            elif isinstance(node, (ast.If, ast.Try)):
                yield from assigned(node.body, where)
    yield from assigned(tree.body, "module")


def _constant_name(name):
    stripped = name.lstrip("_")
    return bool(stripped) and stripped.upper() == stripped and any(c.isalpha() for c in stripped)


def _frozen(node):
    """A class whose instances cannot change: @dataclass(frozen=True) or a NamedTuple."""
    for decorator in node.decorator_list:
        if (isinstance(decorator, ast.Call) and _named(decorator.func) == "dataclass"
                and any(k.arg == "frozen" and getattr(k.value, "value", False) is True for k in decorator.keywords)):
            return True
    return any(_named(base) == "NamedTuple" or getattr(base, "id", None) == "NamedTuple" for base in node.bases)


def process_state_outside_runtime():
    trees = _modules()
    package_classes = {node.name for _, tree in trees for node in ast.walk(tree)
                       if isinstance(node, ast.ClassDef) and not _frozen(node)}
    mutated = _mutated_names(trees)
    found = []
    for path, tree in trees:
        if path == RUNTIME:
            continue
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{where}:{node.lineno}: global {', '.join(node.names)}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in node.decorator_list:
                    target = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if _named(target) in CACHES:
                        found.append(f"{where}:{node.lineno}: {node.name} keeps a cache")
        for line, name, value, scope in _bindings(tree):
            kind = _kind(value, package_classes)
            if kind is None or (name.startswith("__") and name.endswith("__")):
                continue
            if kind == "container" and _constant_name(name) and name not in mutated:
                continue
            why = "changed in place" if kind == "container" and _constant_name(name) else f"mutable ({kind})"
            found.append(f"{where}:{line}: {scope} binds {name}, {why}")
    return found


def test_no_process_state_outside_runtime():
    found = process_state_outside_runtime()
    assert not found, ("process state outside paddle_cp/runtime.py (move it to runtime.state or "
                       "runtime.installed, or make it an immutable constant):\n" + "\n".join(found))


def test_the_scan_finds_each_kind_of_state(tmp_path, monkeypatch):
    """The scan is not blind: each kind of state written into a module of a copy of the package is found."""
    import shutil

    copy = tmp_path / "paddle_cp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "planted.py").write_text(
        "import functools\nimport threading\nimport weakref\n\n"
        "_seen = []\n"
        "TABLE = {'a': 1}\n"
        "LOCAL = threading.local()\n"
        "OWNERS = weakref.WeakKeyDictionary()\n"
        "from .runtime import Installed\n"
        "HELD = Installed()\n"
        "FIXED = {'b': 2}\n"
        "FROZEN = frozenset({'c'})\n\n"
        "class Store:\n    ITEMS = []\n\n"
        "def remember(x):\n    global _last\n    _last = x\n    TABLE['b'] = 2\n    Store.ITEMS.append(x)\n\n"
        "@functools.lru_cache(None)\ndef cached(x):\n    return x\n")
    monkeypatch.setitem(globals(), "PACKAGE", copy)
    monkeypatch.setitem(globals(), "RUNTIME", copy / "runtime.py")
    found = [line.split(": ", 1)[1] for line in process_state_outside_runtime()]
    assert sorted(found) == sorted([
        "module binds _seen, mutable (container)",
        "module binds TABLE, changed in place",
        "module binds LOCAL, mutable (state)",
        "module binds OWNERS, mutable (state)",
        "module binds HELD, mutable (state)",
        "class Store binds ITEMS, changed in place",
        "global _last",
        "cached keeps a cache",
    ])


PLAN_BASES = frozenset({"Plan", "TokenMixer"})


def _plan_classes(trees):
    """Every class of the package deriving from a plan base (by name, through the package's classes)."""
    classes = [(path, node) for path, tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    derived, grew = set(PLAN_BASES), True
    while grew:
        grew = False
        for _, node in classes:
            if node.name not in derived and {_named(base) for base in node.bases} & derived:
                derived.add(node.name)
                grew = True
    return [(path, node) for path, node in classes if node.name in derived]


def _self_attribute(node):
    """`x` for `self.x` (bare, or under subscripts: `self.x[k]`), else None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _writes_to_self(function):
    """(line, attribute) of each change a function makes to `self` or to a container `self` holds."""
    for node in ast.walk(function):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        elif isinstance(node, ast.Call) and _named(node.func) in ("setattr", "delattr") and node.args:
            if isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
                name = node.args[1] if len(node.args) > 1 else None
                yield node.lineno, name.value if isinstance(name, ast.Constant) else "<computed>"
        for target in targets:
            for part in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                attribute = _self_attribute(part)
                if attribute is not None:
                    yield node.lineno, attribute


def state_on_plan_objects(trees=None):
    """Where a plan or token mixer keeps state on itself: a write to `self` outside __init__. A plan object
    is a description (its arguments), applied to any number of models; what one application needs lives in
    the hooks it registers or in runtime."""
    found = []
    for path, node in _plan_classes(trees or _modules()):
        for method in node.body:
            if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.name != "__init__":
                for line, attribute in _writes_to_self(method):
                    found.append(f"{pathlib.Path(path).name}:{line}: {node.name}.{method.name} sets self.{attribute}")
    return found


def test_plans_keep_no_state_on_themselves():
    found = state_on_plan_objects()
    assert not found, ("state kept on plan objects (put what one application needs in the hooks it registers, "
                       "or in runtime.state / runtime.installed):\n" + "\n".join(found))


def test_the_plan_scan_finds_each_kind_of_write():
    planted = ast.parse(
        "class Base(Plan):\n"
        "    def __init__(self, fn):\n        self.fn = fn\n        self._seen = {}\n\n"
        "class Planted(Base):\n"
        "    def apply(self, layer, dims):\n"
        "        self.group = dims.mp\n"
        "        self._seen[layer] = 1\n"
        "        self._seen.setdefault(layer, 2)\n"
        "        self.count += 1\n"
        "        setattr(self, 'x', 1)\n"
        "        def hook(layer, inputs):\n            self.last = inputs\n"
        "        return hook\n\n"
        "class Mixer(TokenMixer):\n"
        "    def attach(self, layer, plan):\n        del self._runs[layer]\n\n"
        "class Unrelated:\n    def apply(self):\n        self.x = 1\n")
    found = [line.split(": ", 1)[1] for line in state_on_plan_objects([(pathlib.Path("planted.py"), planted)])]
    assert sorted(found) == sorted(["Planted.apply sets self.group", "Planted.apply sets self._seen",
                                    "Planted.apply sets self._seen", "Planted.apply sets self.count",
                                    "Planted.apply sets self.x", "Planted.apply sets self.last",
                                    "Mixer.attach sets self._runs"])
