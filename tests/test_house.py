"""The house's layout, checked on the source so that it does not slip again: no import cycles inside
asyncserve (engine.py and step_profile.py once imported each other), the layers import only
downwards (model/ nothing outside itself, ipc/ and kernels/ nothing of asyncserve), and no code
outside engine.py reaches through the engine into its parts (``engine.<part>.<field>``): the actors,
the ingress and the profile use the engine's API or are handed their part."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(*packages: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages."""
    out = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every module an import statement of the file names, wherever it stands (functions and
    TYPE_CHECKING blocks too: a cycle there is still two modules that need each other), plus
    ``module.name`` for each name imported from a module (it may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"x": {"y"}, "y": set()}) == []


def test_no_import_cycles_in_asyncserve():
    modules = _modules("asyncserve")
    graph = {name: {m for m in _imports(name, path) if m in modules and m != name} for name, path in modules.items()}
    assert "asyncserve.step_profile" in graph["asyncserve.engine"]      # the edge whose reverse made the cycle
    assert _cycles(graph) == [], "modules that import each other (move what both need below them)"


def test_layers_import_downwards_only():
    for package, allowed in (("asyncserve/model", "asyncserve.model"), ("ipc", None), ("kernels", None)):
        for name, path in _modules(package).items():
            outside = sorted(m for m in _imports(name, path)
                             if m.split(".")[0] == "asyncserve" and (allowed is None or not m.startswith(allowed)))
            assert not outside, f"{path.relative_to(ROOT)} imports {outside}, above its layer"


def _reach_throughs(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each ``engine.<part>.<field>``: an attribute of an attribute of a name or
    attribute called ``engine`` (comments and strings do not count)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            owner = node.value.value
            if (isinstance(owner, ast.Name) and owner.id == "engine") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "engine"):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_reach_through_finder():
    source = ("x = engine.pager.registry\ny = self.server.engine.latency.measured\nz = engine.parked.values()\n"
              "ok = engine.adapter_rank(name)\nalso_ok = engine.tokenizer\n# engine.pool.block_size in a comment\n"
              "s = 'engine.pool.block_size in a string'\n")
    assert [line for line, _ in _reach_throughs(source)] == [1, 2, 3]


def test_no_reach_through_the_engine_outside_it():
    found = []
    for path in sorted((ROOT / "asyncserve").rglob("*.py")):
        if path.name == "engine.py" and path.parent.name == "asyncserve":
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {expr}" for line, expr in _reach_throughs(path.read_text())]
    assert not found, ("code outside engine.py reaches into the engine's parts; add to the engine's API or hand "
                       "the part over directly:\n" + "\n".join(found))
