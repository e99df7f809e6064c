"""The package's import graph has no circle: every module, each import statement read from its source (imports
inside functions and under TYPE_CHECKING included), edges to the package's own modules only."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "areal_hex_plugin"


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import sub`` counts as an import of ``pkg.sub``
    where ``sub`` is a module, else of ``pkg``)."""
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                subs = {f"{base}.{a.name}" for a in node.names} & files.keys()
                out |= subs or ({base} & files.keys())
        graph[name] = out - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

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
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# docs/architecture.md's floors, top first: a module imports only from its own floor or the ones below.
FLOORS = [
    ("driver", "cli", "commands"),
    ("areal.trainer",),
    ("areal.preflight", "areal.startup", "areal.launch", "areal.schedulers"),
    ("areal.session", "areal.elastic", "areal.join", "areal.transport_setup", "areal.metrics", "areal.update_window",
     "areal.run_guard", "areal.refit_loop", "areal.server_stats"),
    ("areal.rewrite", "areal.engines", "areal.routing", "areal.sglang_flags", "areal.megatron_actor",
     "areal.megatron_layout", "areal.profile_decode", "areal.profile_train"),
    ("areal.worker_slots", "areal.plugin", "areal.config", "areal"),
    ("transport",),
    ("sim", "saved_plan", "inventory", "joins", "schemas"),
    ("planner",),
    ("plan",),
    ("costmodel",),
    ("specs",),
    ("errors", "tables", "outfiles", "progress", "hostlist", ""),
]  # fmt: skip
# The one import that runs back up: the recipe reader builds the recipe's calibration and checks its memory.
UPWARD = {
    ("areal_hex_plugin.specs.recipe", "areal_hex_plugin.costmodel.calibration"),
    ("areal_hex_plugin.specs.recipe", "areal_hex_plugin.costmodel.memory"),
}


def floor(module: str) -> int:
    """The floor of ``module`` (``areal_hex_plugin.x.y``): the longest prefix listed in FLOORS."""
    name = module.removeprefix("areal_hex_plugin").removeprefix(".")
    found = [
        (len(prefix), level)
        for level, prefixes in enumerate(FLOORS)
        for prefix in prefixes
        if name == prefix or name.startswith(f"{prefix}.") or (prefix == "" and "." not in name)
    ]
    assert found, f"{module} is on no floor of docs/architecture.md"
    return max(found)[1]


def test_imports_point_down_the_floors_but_one():
    graph = import_graph()
    upward = {(a, b) for a, outs in graph.items() for b in outs if floor(b) < floor(a)}
    assert upward == UPWARD
