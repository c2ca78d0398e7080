"""The layers of DESIGN §3, checked on the source: every import statement (lazy ones too).

probes, collectors and replay depend on auditor's model, never on each other; only
``auditor.daemon`` and ``auditor.cli`` wire them together; nothing outside ``auditor`` reaches into
the store's or the CLI's modules; the reference engine does not import correlation; probes write
through ``auditor.sink`` and never touch the store; no component imports in a cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("auditor", "probes", "collectors", "replay")
SOURCES = ("probes", "collectors", "replay")
# The auditor modules allowed to import the source packages: where they are wired together.
WIRING = ("auditor.daemon", "auditor.cli", "auditor.__main__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(tree: ast.AST, module: str) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the tree, relative ones resolved."""
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], base]).rstrip(".")
            yield node.lineno, base
            for alias in node.names:  # `from auditor import store` imports the package auditor.store
                yield node.lineno, f"{base}.{alias.name}"


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def component(name: str) -> str:
    """The unit the cycle check works on: a source package, or auditor's first-level part."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "auditor" and len(parts) > 1 else parts[0]


def violations(module: str, tree: ast.AST) -> list[str]:
    found = []
    top = module.split(".")[0]
    for line, target in imports(tree, module):
        if target.split(".")[0] not in PACKAGES:
            continue
        where = f"{module}:{line} imports {target}"
        if top in SOURCES:
            if target.split(".")[0] in SOURCES and target.split(".")[0] != top:
                found.append(f"{where}: {top} must not import another source package")
            if under(target, "auditor.cli", "auditor.daemon"):
                found.append(f"{where}: sources must not import the wiring layer")
            if under(target, "auditor.store") and target not in ("auditor.store", *tuple(f"auditor.store.{n}" for n in STORE_PUBLIC)):
                found.append(f"{where}: import the store's public names from auditor.store only")
        if top == "probes" and under(target, "auditor.store"):
            found.append(f"{where}: probes write through auditor.sink, not the store")
        if under(module, "replay.engine") and under(target, "auditor.correlate"):
            found.append(f"{where}: the reference engine must not import correlation")
        if top == "auditor" and not under(module, *WIRING) and target.split(".")[0] in SOURCES:
            found.append(f"{where}: only {', '.join(WIRING)} may import source packages")
        if top == "auditor" and not under(module, "auditor.cli", "auditor.__main__") and under(target, "auditor.cli"):
            found.append(f"{where}: the CLI is the top layer; nothing below imports it")
    for node in ast.walk(tree):  # the store's private methods are its own
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id == "store"
                and not under(module, "auditor.store")):
            found.append(f"{module}:{node.lineno} calls store.{node.attr}: private to auditor.store")
    return found


def _store_public() -> frozenset[str]:
    tree = ast.parse((ROOT / "auditor" / "store" / "__init__.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return frozenset(names)


STORE_PUBLIC = _store_public()


def project_modules() -> dict[str, ast.AST]:
    return {module_name(path): ast.parse(path.read_text(), str(path))
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if "migrations" not in path.parts}


def test_no_import_crosses_a_layer_backwards() -> None:
    problems = [v for module, tree in project_modules().items() for v in violations(module, tree)]
    assert not problems, "\n".join(problems)


def test_components_import_without_cycles() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, tree in project_modules().items():
        for _line, target in imports(tree, module):
            if target.split(".")[0] in PACKAGES and component(target) != component(module):
                graph[component(module)].add(component(target))
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append([*path[path.index(nxt):], nxt])
            elif len(path) < 12:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


@pytest.mark.parametrize(("module", "source", "message"), [
    ("collectors.otlp_http", "from auditor.cli.util import open_store", "wiring layer"),
    ("probes.writer", "from auditor.store import Store", "auditor.sink"),
    ("replay.run", "from auditor.store.db import Store", "public names"),
    ("replay.engine.tracing", "from auditor.correlate.traces import norm_addr", "must not import correlation"),
    ("collectors.nvml", "def f():\n    from probes import open_source", "another source package"),
    ("auditor.correlate.waste", "from collectors.procfs import ProcSampler", "only auditor.daemon"),
    ("replay.capture", "def f(store):\n    return store._where()", "private to auditor.store"),
    ("auditor.report.query", "from auditor.cli.util import TIME", "top layer"),
])
def test_the_check_catches_a_backward_import(module: str, source: str, message: str) -> None:
    found = violations(module, ast.parse(source))
    assert any(message in v for v in found), found


def test_the_check_lets_the_wiring_import_everything() -> None:
    tree = ast.parse("from probes import open_source\nfrom collectors.live import LiveReceiver\n"
                     "from replay.session import run_replay\nfrom auditor.store.schema import SpanRow")
    assert violations("auditor.daemon", tree) == []
    assert violations("auditor.cli.replay", tree) == []
