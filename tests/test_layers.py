"""The serving package's layers, read from its imports: no import circle, and each layer imports only
the layers below it.

    http/         routes, request bodies, admission, auth, chat, JSON Lines   (may import everything below)
    contracts/    the wire contracts: request -> job, answer -> response     (engine, postprocess)
    postprocess/  calibration and the abstention policy, after scoring       (engine)
    engine/       the llama.cpp context, plans, prompts, labels, batching    (nothing above)

`config` and `logs` are shared by all; `settings_contract` (the definition of every SEMIF_* setting, standard
library only, which the CDK app imports too) sits below `config` and imports nothing of the package; `serve` (the
process) may import anything and nothing imports it.
Function-level imports count: a circle closed inside a function is still a circle.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "container" / "semif" / "serving"
ROOT = "semif.serving"
# layer -> the layers (first component under semif.serving) it may import
SHARED = {"config", "logs", "settings_contract"}
ALLOWED = {
    "engine": {"engine"} | SHARED,
    "postprocess": {"postprocess", "engine"} | SHARED,
    "contracts": {"contracts", "postprocess", "engine"} | SHARED,
    "http": {"http", "contracts", "postprocess", "engine"} | SHARED,
    "config": {"config", "settings_contract"},
    "logs": {"logs", "config", "settings_contract"},
    "settings_contract": {"settings_contract"},
    "serve": {"http", "contracts", "postprocess", "engine", "serve"} | SHARED,
    "__init__": set(),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((ROOT, *parts))


def _imports(path: Path) -> set[str]:
    """Modules of semif.serving that `path` imports (anywhere in the file)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # "from . import chat": a module
    return {m for m in found if m == ROOT or m.startswith(ROOT + ".")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # keep only names that are modules (an imported class resolves to its module)
        deps = set()
        for imported in _imports(path):
            while imported not in modules and "." in imported:
                imported = imported.rpartition(".")[0]
            if imported in modules and imported != name and imported != ROOT:
                deps.add(imported)
        graph[name] = deps
    return graph


def _layer(module: str) -> str:
    rest = module[len(ROOT) + 1:] if module != ROOT else "__init__"
    return rest.split(".")[0]


def test_the_walk_sees_the_package():
    graph = _graph()
    assert f"{ROOT}.http.app" in graph and f"{ROOT}.engine.context" in graph
    assert f"{ROOT}.engine.context" in graph[f"{ROOT}.http.app"]  # a plain `from ..engine.context import`
    assert f"{ROOT}.http.chat" in graph[f"{ROOT}.http.app"]  # `from . import chat`
    assert f"{ROOT}.engine.batching" in graph[f"{ROOT}.engine.context"]  # a function-level import


def test_the_serving_package_has_no_import_circle():
    try:
        tuple(graphlib.TopologicalSorter(_graph()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def test_each_layer_imports_only_the_layers_below_it():
    wrong = [f"{module} imports {dep}" for module, deps in sorted(_graph().items()) for dep in sorted(deps)
             if _layer(dep) not in ALLOWED[_layer(module)]]
    assert not wrong, "\n".join(wrong)


def test_every_module_belongs_to_a_known_layer():
    assert {_layer(m) for m in _graph()} <= set(ALLOWED)
