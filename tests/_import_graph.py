"""The project's import graph read from source (ast), and the layering rules of DESIGN.md §3 checked on it.

Every import statement counts, at module level or inside a function: a function-local import may exist to keep
start-up fast, never to hide a cycle, so the cycle checks see it like any other import.
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("jaxrl_vlm", "rollout", "envs")
JAX_STACK = ("jax", "jaxlib", "flax", "optax", "orbax")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (project module, or the top-level name of an external one)
    where: str  # file:line


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path) -> dict[str, Path]:
    return {_module_name(root, p): p for top in ROOTS for p in sorted((root / top).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest project module that `name` starts with, or None for an external module."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in modules:
            return candidate
    return None


@functools.lru_cache(maxsize=1024)
def _import_nodes(source: str) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """The import statements of one file's source (cached by content: the rule tests re-read copies of the tree
    that differ in one file)."""
    return tuple(n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom)))


def import_edges(root: Path) -> list[Edge]:
    modules = project_modules(root)
    edges: list[Edge] = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        rel = path.relative_to(root)
        for node in _import_nodes(path.read_text()):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                # `from pkg import sub` imports the submodule when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            where = f"{rel}:{node.lineno}"
            for target in targets:
                resolved = _resolve(target, modules)
                edges.append(Edge(name, resolved or target.split(".")[0], where))
    return edges


def package_of(module: str) -> str:
    """The layering unit: `rollout`, `envs`, or one direct child of `jaxrl_vlm` (sub-package or module). Two units
    that import each other, through any modules, are a package cycle: no module of a package is exempt."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "jaxrl_vlm" and len(parts) > 1 else parts[0]


def _is_project(module: str) -> bool:
    return module.split(".")[0] in ROOTS


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(root: Path) -> list[str]:
    """Every broken layering rule, one readable line each (empty when the tree follows DESIGN.md §3)."""
    edges = import_edges(root)
    problems: list[str] = []

    module_graph: dict[str, set[str]] = defaultdict(set)
    first_edge: dict[tuple[str, str], Edge] = {}
    for e in edges:
        module_graph[e.source].add(e.target)
        first_edge.setdefault((e.source, e.target), e)

    def chain(start: str, bad: tuple[str, ...]) -> list[Edge] | None:
        """The import path from `start` to a module under one of `bad` (breadth first), or None."""
        parent: dict[str, str] = {start: start}
        queue = [start]
        for v in queue:
            for w in sorted(module_graph.get(v, ())):
                if w in parent:
                    continue
                parent[w] = v
                if any(w == b or w.startswith(b + ".") for b in bad):
                    path, node = [], w
                    while node != start:
                        path.append(first_edge[(parent[node], node)])
                        node = parent[node]
                    return path[::-1]
                if _is_project(w):
                    queue.append(w)
        return None

    def forbid(source_pkgs: tuple[str, ...], bad: tuple[str, ...], why: str) -> None:
        """No module of `source_pkgs` reaches `bad`, directly or through other project modules."""
        for module in sorted(module_graph):
            if package_of(module).startswith(source_pkgs):
                path = chain(module, bad)
                if path:
                    hops = " -> ".join([path[0].source, *(e.target for e in path)])
                    problems.append(f"{path[0].where}: {hops} ({why})")

    forbid(("rollout", "envs"), JAX_STACK + ("jaxrl_vlm",), "rollout/ and envs/ never import jax or the trainer side")
    forbid(("jaxrl_vlm.rl",), ("jaxrl_vlm.engine", "jaxrl_vlm.job", "rollout.client"),
           "rl/ is RL math: no engine, job or rollout client")
    forbid(("jaxrl_vlm.models",), ("jaxrl_vlm.config", "rollout", "jaxrl_vlm.job"),
           "models/ never import the config, the rollout or the job")
    forbid(("jaxrl_vlm.models",), ("jaxrl_vlm.sharding",),
           "models/ never import sharding/ (which places models; the model only names its axes)")
    forbid(("jaxrl_vlm.sharding.rules",), ("jaxrl_vlm.config", "jaxrl_vlm.models"),
           "the sharding rules import neither config nor models")
    # Nothing but the command line depends on the job.
    for e in edges:
        if e.target.startswith("jaxrl_vlm.job") and package_of(e.source) not in ("jaxrl_vlm.job", "jaxrl_vlm.cli",
                                                                                  "jaxrl_vlm.bench"):
            problems.append(f"{e.where}: {e.source} imports {e.target} (only the CLI and benches use the job)")

    package_graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        if not _is_project(e.target) or e.target == e.source:
            continue
        a, b = package_of(e.source), package_of(e.target)
        if a != b:
            package_graph[a].add(b)
    for cycle in _cycles(package_graph):
        ties = sorted({f"{e.where} ({e.source} -> {e.target})" for e in edges
                       if package_of(e.source) in cycle and package_of(e.target) in cycle
                       and package_of(e.source) != package_of(e.target)})
        problems.append(f"package cycle {' <-> '.join(cycle)}: " + "; ".join(ties))
    project_graph = {m: {t for t in ts if _is_project(t) and t != m} for m, ts in module_graph.items()}
    for cycle in _cycles(project_graph):
        problems.append(f"module cycle {' <-> '.join(cycle)}")
    return problems
