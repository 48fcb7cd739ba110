"""The import graph of formwork's own modules, read from the source with `ast`
(module-level and function-level imports alike): no cycles, and no edge
upward through the layers schemas < kernels < grammar, gpu < core < gateway
(grammar and gpu do not import each other). Modules are named by their path
(gateway/extract/cli.py is formwork.gateway.extract.cli, a package's
`__init__.py` is the package), so cycles inside sub-packages count too."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"schemas": 0, "kernels": 1, "grammar": 2, "gpu": 2, "core": 3, "gateway": 4}


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("formwork",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    return {module_name(root, f): f for pkg in LAYERS for f in (root / pkg).rglob("*.py")}


def _imported(node: ast.AST, name: str, is_package: bool) -> list[str]:
    """Module names an import statement in module `name` may refer to."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:                      # relative: from the package `name` is in (or is)
        pkg = name.split(".")
        pkg = pkg[:len(pkg) - node.level + (1 if is_package else 0)]
        base = ".".join(pkg + ([base] if base else []))
    if not base.startswith("formwork."):
        return []
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_package = path.stem == "__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            graph[name] |= {t for t in _imported(node, name, is_package) if t in mods and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS, colours)."""
    colour = dict.fromkeys(graph, 0)          # 0 new, 1 on the stack, 2 done
    for start in graph:
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def test_graph_is_read():
    graph = import_graph()
    assert "formwork.gpu.model" in graph["formwork.gpu.executor"]       # the reader sees edges
    assert "formwork.gateway.extract.prompt" in graph["formwork.gateway.extract.server"]
    assert "formwork.gateway.extract.cli" in graph["formwork.gateway.cli"]   # `from pkg import mod`
    assert "formwork.gateway.extract" in graph                          # the package's __init__
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_cycle_inside_a_subpackage_is_found(tmp_path):
    """A sub-package's modules keep their full names (two `io.py`s do not merge),
    and absolute and relative imports between them both make edges."""
    pkg = tmp_path / "gateway" / "app"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The app."""\n')
    (pkg / "io.py").write_text("from formwork.gateway.app.cli import main\n")
    (pkg / "cli.py").write_text("from . import io\n\ndef main():\n    pass\n")
    (tmp_path / "gateway" / "io.py").write_text("import json\n")
    graph = import_graph(tmp_path)
    assert graph["formwork.gateway.app.io"] == {"formwork.gateway.app.cli"}
    assert graph["formwork.gateway.app.cli"] == {"formwork.gateway.app", "formwork.gateway.app.io"}
    assert graph["formwork.gateway.io"] == set()
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) == 3, cycle
    assert set(cycle) == {"formwork.gateway.app.cli", "formwork.gateway.app.io"}


def test_no_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_upward_edges():
    bad = [(a, b) for a, targets in import_graph().items() for b in targets
           if (la := LAYERS[a.split(".")[1]]) < (lb := LAYERS[b.split(".")[1]])
           or (la == lb and a.split(".")[1] != b.split(".")[1])]
    assert not bad, bad
