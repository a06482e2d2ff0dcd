"""The package's shape, checked: no import circle among hf_diloco's modules (imports inside functions included, so
a circle cannot hide behind a late import), and no class over 300 lines (configuration dataclasses aside)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_diloco"


def imports() -> dict[str, set[str]]:
    """module -> the hf_diloco modules it imports, at any depth of its code."""
    graph = {}
    for path in PACKAGE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_diloco."):
                found.add(node.module.split(".")[1])
        graph[path.stem] = {name for name in found if (PACKAGE / f"{name}.py").exists()} - {path.stem}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_late_imports_included():
    graph = imports()
    assert len(graph) > 30 and "trl" in graph["recipes"]
    assert circles(graph) == []


# Configuration dataclasses: one field per setting, each with its help; long by nature.
CONFIGURATIONS = {"DiLoCoConfig", "RunArguments"}


def test_no_class_over_300_lines_configurations_aside():
    long = {}
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in CONFIGURATIONS and \
                    node.end_lineno - node.lineno + 1 > 300:
                long[f"{path.stem}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}
