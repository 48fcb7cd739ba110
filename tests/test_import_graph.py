"""The import graph of formwork's own modules, read from the source with `ast`
(module-level and function-level imports alike): no cycles, and no edge
upward through the layers schemas < kernels < grammar, gpu < core < gateway
(grammar and gpu do not import each other)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"schemas": 0, "kernels": 1, "grammar": 2, "gpu": 2, "core": 3, "gateway": 4}


def modules() -> dict[str, pathlib.Path]:
    return {f"formwork.{pkg}.{f.stem}": f for pkg in LAYERS for f in (ROOT / pkg).rglob("*.py")
            if f.stem != "__init__"}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("formwork."):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in mods and t != name}
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
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_upward_edges():
    bad = [(a, b) for a, targets in import_graph().items() for b in targets
           if (la := LAYERS[a.split(".")[1]]) < (lb := LAYERS[b.split(".")[1]])
           or (la == lb and a.split(".")[1] != b.split(".")[1])]
    assert not bad, bad
