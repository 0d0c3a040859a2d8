"""The house rule (docs/architecture.md): a module imports only modules of its own layer or below, and the
import graph of the package has no cycle. Read from the source with `ast`, imports inside functions included."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "speedllm"

# Lowest first. A name is a top-level module or subpackage of speedllm.
LAYERS = [
    ("ground", ["errors", "paths", "native", "storage", "outputs", "console"]),
    ("leaves", ["ops", "models", "quant", "adapters", "data", "hardware"]),
    ("machinery", ["parallel", "checkpoint", "runtime"]),
    ("recipes", ["generation", "train", "planner"]),
    ("tasks", ["tasks"]),
    ("resolve and check", ["config"]),
    ("entry", ["launcher", "cli"]),
]
LAYER_OF = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}


def modules() -> dict:
    """speedllm.<dotted name> -> source file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict:
    """module -> the set of package modules it imports (the longest existing prefix of each imported name)."""
    mods = modules()

    def owner(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    targets.add(owner(f"{base}.{alias.name}") or owner(base))
        graph[mod] = {t for t in targets if t and t.startswith("speedllm") and t != mod}
    return graph


def layer(mod: str) -> int:
    room = mod.split(".")[1] if "." in mod else None
    if room is None:  # the package's own __init__: below everything
        return -1
    assert room in LAYER_OF, f"speedllm.{room} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return LAYER_OF[room]


def test_every_room_has_a_layer():
    for mod in modules():
        layer(mod)


def upward_imports(graph: dict) -> list:
    return [(mod, target) for mod, targets in sorted(graph.items()) for target in sorted(targets)
            if layer(target) > layer(mod)]


def test_no_import_runs_up_a_layer():
    upward = upward_imports(import_graph())
    assert not upward, "imports that run up a layer (move the name down, DESIGN.md 'Layers'):\n" + "\n".join(
        f"{mod} ({LAYERS[layer(mod)][0]}) imports {target} ({LAYERS[layer(target)][0]})" for mod, target in upward)


def test_no_import_cycle():
    graph, state, stack, cycles = import_graph(), {}, [], []

    def visit(mod):
        state[mod] = "open"
        stack.append(mod)
        for target in sorted(graph[mod]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[mod] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_rule_catches_an_upward_import():
    """The check is live: a library module that imports a task is reported."""
    graph = import_graph()
    graph["speedllm.models.qwen3"] = graph["speedllm.models.qwen3"] | {"speedllm.tasks.pretrain"}
    assert upward_imports(graph) == [("speedllm.models.qwen3", "speedllm.tasks.pretrain")]
