"""The package's shape, checked: no import circle among hf_diloco's modules (imports inside functions included, so
a circle cannot hide behind a late import), and nothing under the Trainer callback touches the Trainer: the sync
engine and every module it imports is handed values (parameters, the inner optimizer, the communicator, a held-out
loss) and answers with values (hf_diloco.engine.SyncOutcome), which the callback applies."""

import ast
from pathlib import Path

import pytest

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


def closure(graph: dict[str, set[str]], module: str) -> set[str]:
    """`module` and every module it imports, directly or not."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return seen


# What Trainer's objects hold that a sync must not read or write: its step and learning-rate schedule, its control's
# flags, its private helpers, its data, and the callback's own levers.
TRAINER_ATTRIBUTES = {"trainer", "global_step", "lr_scheduler", "_prepare_inputs", "data_collator", "eval_dataset",
                      "train_dataset", "callback_handler", "should_save", "should_evaluate",
                      "should_training_stop", "continue_at_step", "is_world_process_zero", "accelerator"}


def trainer_contacts(source: str) -> list[str]:
    """Where `source` imports transformers (at any depth) or reads an attribute of TRAINER_ATTRIBUTES, as
    'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "transformers"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
            found.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Attribute) and node.attr in TRAINER_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_the_contact_finder_finds_an_import_and_a_step_read():
    source = "def f(t):\n    from transformers import Trainer\n    return t.state.global_step\n"
    assert trainer_contacts(source) == ["2: from transformers import", "3: .global_step"]


def test_nothing_under_the_callback_imports_transformers_or_touches_trainer_state():
    """Every module the sync engine reaches (hf_diloco.engine and its imports, at any depth) is free of transformers
    and of Trainer's state, except the configuration (DiLoCoConfig extends TrainingArguments; what it imports comes
    along) and compat (each of its workarounds over a library says what upstream change it waits for)."""
    graph = imports()
    under = closure(graph, "engine") - closure(graph, "config") - {"compat"}
    assert {"engine", "backends", "torchft_backend", "gate", "health", "outer", "fragments", "records"} <= under
    contacts = {name: trainer_contacts((PACKAGE / f"{name}.py").read_text()) for name in sorted(under)}
    assert {name: found for name, found in contacts.items() if found} == {}


def hops(*flags: str) -> dict[str, list[str]]:
    """benchmarks/hops.py's call chains of one sync (tiny model, one replica, this tree): target → the hf_diloco
    frames from the callback's on_step_end (or the top of the engine's background thread) down to it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(PACKAGE.parent / "benchmarks" / "hops.py"), *flags],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    chains, current = {}, None
    for line in out.stdout.splitlines():
        if line.startswith("hops to "):
            current = chains.setdefault(line[len("hops to "):].split(":")[0], [])
        elif line.startswith("  ") and current is not None:
            current.append(line.strip())
        else:
            current = None
    return chains


@pytest.mark.process
@pytest.mark.parametrize("flags", [(), ("--sync-delay", "1"), ("--backend", "torchft")],
                         ids=["torch-blocking", "torch-overlapped", "torchft-blocking"])
def test_a_sync_reaches_the_network_and_the_copy_back_through_the_fragments_verbs(flags):
    """From the callback, every sync reaches θ_i ← θ_global only through Fragment.copy_back, called by the sync's
    own function (outer_round for a blocking one, land for an overlapped or voted one) under SyncEngine.land; its
    network is comm's sum_replicas under the fragments' average (_average_bucket), in the inner loop for a blocking
    sync and in the engine's background thread (_in_background, then exchange) for an overlapped one. Measured on a
    real run (benchmarks/hops.py, which records the chains with sys.setprofile)."""
    chains = hops(*flags)
    copy = chains["copy_back"]
    assert copy[0] == "diloco_callback.DiLoCoCallback.on_step_end" and copy[-1] == "fragments.Fragment.copy_back"
    assert "engine.SyncEngine.land" in copy
    overlapped = "--sync-delay" in flags
    assert copy[-2] == ("fragments.land" if overlapped or "torchft" in flags else "fragments.outer_round"), copy
    network = chains["sum_replicas (background thread)" if overlapped else "sum_replicas"]
    assert network[-2:] == ["fragments._average_bucket", "comm.ReplicaComm.sum_replicas"], network
    assert network[0] == ("engine.SyncEngine._in_background" if overlapped else
                          "diloco_callback.DiLoCoCallback.on_step_end"), network
    assert not any(hop.startswith(("trainer.", "transformers")) for hop in copy + network)
