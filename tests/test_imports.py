"""The package imports downward only: the import graph of `jaxrl_llm`, read from the source.

Every `import` / `from … import` statement counts, the ones inside functions too (the package
imports lazily to keep `--help` fast, and a lazy import is still a dependency). Nodes are the
subpackages (`losses`, `models`, …) and the top-level modules (`config`, `export`, …).
Module names kept as strings for `importlib` (the command table of `commands/__init__.py`,
`--schema` in `commands/config.py`) are the command layer's dispatch and are not counted.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxrl_llm"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Cycles that exist today and are not yet broken, as (from, to) edges: none. Add an edge here
# only with a comment saying why, so that a NEW cycle still fails the test.
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, module: str | None = None) -> set[str]:
    """Absolute names of the `jaxrl_llm` modules `path` (module `module`, default: from its
    place in the tree) imports, at any nesting level."""
    module = module or _module_name(path)
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names.add(stem)
            names.update(f"{stem}.{alias.name}" for alias in node.names)  # `from pkg import mod`
    return {n for n in names if n == "jaxrl_llm" or n.startswith("jaxrl_llm.")}


def _node(module: str) -> str | None:
    """The graph node of a module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _top_nodes() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


@lru_cache(maxsize=1)
def import_graph() -> dict[str, dict[str, set[str]]]:
    """node -> {imported node -> the files (relative paths) whose imports make that edge}."""
    nodes = _top_nodes()
    graph: dict[str, dict[str, set[str]]] = {n: {} for n in nodes}
    for path in PACKAGE.rglob("*.py"):
        src = _node(_module_name(path))
        if src is None:
            continue
        for name in _imported_modules(path):
            dst = _node(name)
            if dst is not None and dst != src and dst in nodes:
                graph[src].setdefault(dst, set()).add(str(path.relative_to(ROOT)))
    return graph


def find_cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def documented_dependencies() -> dict[str, set[str]]:
    """The "depends on" column of the module map in docs/architecture.md, per subpackage."""
    nodes = _top_nodes()
    table: dict[str, set[str]] = {}
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `(\w+)/` \|.*\| (.*) \|$", line)
        if m:
            table[m.group(1)] = {name for name in re.findall(r"`(\w+)`", m.group(2)) if name in nodes}
    return table


def _describe(graph: dict[str, dict[str, set[str]]], src: str, dsts: set[str]) -> str:
    return "; ".join(f"{src} -> {d} ({', '.join(sorted(graph[src][d]))})" for d in sorted(dsts))


# -- the graph reader itself ------------------------------------------------------------------


def test_function_level_and_relative_imports_count(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom jaxrl_llm.losses import registry\n"
                     "def f():\n    from jaxrl_llm.train.step import forward\n"
                     "    import jaxrl_llm.weights.hf\n"
                     "class C:\n    def g(self):\n        from ..tasks import base\n")
    found = _imported_modules(probe, "jaxrl_llm.data.probe")
    assert {"jaxrl_llm.losses.registry", "jaxrl_llm.train.step", "jaxrl_llm.weights.hf",
            "jaxrl_llm.tasks.base"} <= found
    assert {_node(n) for n in found} == {"losses", "train", "weights", "tasks"}


def test_cycle_finder_finds_a_cycle_through_a_third_node_and_none_in_a_chain() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# -- the package ------------------------------------------------------------------------------


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert {"losses", "models", "parallel", "data", "tasks", "generate", "train", "eval",
            "config", "cli", "commands"} <= set(graph)
    assert "losses" in graph["train"] and "models" in graph["train"]  # known real edges


def test_the_top_level_holds_only_entry_points() -> None:
    """Loose modules at the top are the three entry points; everything else sits in a package
    whose floor its name says (`core` at the bottom, `flows` at the top: docs/architecture.md)."""
    loose = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert loose == {"api", "cli", "chain"}, loose


def test_core_is_the_floor() -> None:
    graph = import_graph()
    assert not graph["core"], "core must import nothing else of the package: " + _describe(
        graph, "core", set(graph["core"]))


def test_losses_is_a_leaf_and_models_imports_only_parallel_and_errors() -> None:
    graph = import_graph()
    assert not graph["losses"], "losses must import nothing of the package: " + _describe(
        graph, "losses", set(graph["losses"]))
    # models must not read experiment configs: ConfigError comes from `core.errors`, not `config`
    extra = set(graph["models"]) - {"parallel", "core"}
    assert not extra, "models may import only parallel and core: " + _describe(
        graph, "models", extra)
    assert "config" not in graph["parallel"], "parallel reads its sizes, not the config: " + (
        _describe(graph, "parallel", {"config"}))


@pytest.mark.parametrize("package", ["core", "config", "losses", "models", "weights", "sampling",
                                     "parallel", "data", "tasks", "envs", "generate", "train",
                                     "policy",
                                     "eval", "online", "flows", "plan", "commands"])
def test_docs_module_map_lists_exactly_the_imports(package: str) -> None:
    documented = documented_dependencies()
    assert package in documented, f"docs/architecture.md module map has no row for `{package}/`"
    graph = import_graph()
    actual = set(graph[package])
    assert actual == documented[package], (
        f"docs/architecture.md says `{package}/` depends on {sorted(documented[package])}; the "
        f"source imports {sorted(actual)}: " + _describe(graph, package, actual - documented[package])
        + " — fix the import or the table")


def test_commands_is_the_top_layer() -> None:
    """The stage commands import the library; no library module imports them (only the
    `jaxrl-llm` dispatcher and `chain.py`, which parses the commands' documented lines)."""
    graph = import_graph()
    importers = {src for src, dsts in graph.items() if "commands" in dsts}
    assert importers <= {"cli", "chain"}, "library modules import the command layer: " + "; ".join(
        _describe(graph, src, {"commands"}) for src in sorted(importers - {"cli", "chain"}))
    assert {"train", "generate", "data", "eval"} <= set(graph["commands"])


def test_no_cycle_between_packages() -> None:
    graph = import_graph()
    edges = {src: {d for d in dsts if (src, d) not in KNOWN_CYCLE_EDGES}
             for src, dsts in graph.items()}
    cycles = find_cycles(edges)
    detail = [" <-> ".join(c) + ": " + "; ".join(_describe(graph, s, set(graph[s]) & set(c))
                                                 for s in c) for c in cycles]
    assert not cycles, "import cycles between packages:\n" + "\n".join(detail)


def test_no_cycle_between_modules() -> None:
    """Module-level graph (e.g. train/checkpoint.py <-> train/trainer.py), lazy imports included."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: {o for n in _imported_modules(p) if (o := owner(n)) not in (None, m, "jaxrl_llm")}
             for m, p in modules.items()}
    assert find_cycles(edges) == []
