"""The package's folders form layers: a module imports only its own folder and
the folders below it, so the folder graph has no cycles (docs/architecture.md).
Every import counts, including those inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sidecar"

# Top to bottom. A root module (errors, metrics, decision, contract) is a layer of its own.
LAYERS = (
    "__main__", "commands", "devstack", "deploy", "serve", "handlers", "experiments", "accounting",
    "backends", "routing", "stores", "metrics", "config", "payload", "errors", "decision", "contract", "_proto",
)
# What serve's process must never load: the local stack and the demo engine.
NEVER_SERVED = ("devstack",)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if "_proto" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> set[str]:
    """Every sidecar module (or package) ``module`` imports, anywhere in its text."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m == "sidecar" or m.startswith("sidecar.")}


def _rank(module: str) -> int:
    return LAYERS.index(_layer(module))


def test_every_folder_and_root_module_has_a_layer():
    unplaced = sorted({_layer(m) for m in MODULES} - set(LAYERS) - {"__init__"})
    assert unplaced == [], f"place these in LAYERS (and docs/architecture.md): {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, path in sorted(MODULES.items()):
        if _layer(module) == "__init__":
            continue
        for target in sorted(_imports(module, path)):
            if target != "sidecar" and _layer(target) != _layer(module) and _rank(target) < _rank(module):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_import_names_a_module_that_exists():
    # A stale path (a module that moved) is caught here even inside a function,
    # where nothing runs it until the one request that needs it.
    missing = []
    for module, path in sorted(MODULES.items()):
        for target in sorted(_imports(module, path)):
            if target not in MODULES and target != "sidecar" and not target.startswith("sidecar._proto"):
                missing.append(f"{module} -> {target}")
    assert missing == []


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        todo.extend(_imports(module, MODULES[module]))
    return seen


@pytest.mark.parametrize("entry", ["sidecar.serve.server", "sidecar.handlers.extproc"])
def test_the_serving_process_never_loads_the_dev_stack(entry):
    loaded = sorted(m for m in _reachable(entry) if _layer(m) in NEVER_SERVED)
    assert loaded == []


def test_the_check_sees_an_upward_import(tmp_path):
    # The walk itself: a relative import from routing up into handlers is found.
    fake = tmp_path / "x.py"
    fake.write_text("from ..handlers import extproc\n")
    assert _imports("sidecar.routing.x", fake) == {"sidecar.handlers.extproc"}
    assert _rank("sidecar.handlers.extproc") < _rank("sidecar.routing.x")


def test_the_monitor_state_is_a_routing_backend_view():
    # Routing reads backends through a protocol; the monitor's state must satisfy it
    # (mypy checks the same when both sides are typed).
    from sidecar.backends.state import BackendState
    from sidecar.routing.selection import BackendView

    members = [name for name in dir(BackendView) if not name.startswith("_")]
    state = BackendState("a")
    assert members and all(hasattr(state, name) for name in members)
