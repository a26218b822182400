"""CI's cycle check: no import cycle among raydeck's modules, nor among its packages at any
depth, counting every import (a function's own, and ``if TYPE_CHECKING:`` ones, included).

Why beside ``lint-imports``: a layers contract sees only imports that cross its layers, so a
cycle inside one package (two modules that import each other, one of them inside a function)
passes it. grimp, which import-linter is built on, gives the whole graph; this computes its
strongly connected components (Tarjan) over modules, then over packages squashed to each depth
(``raydeck.tracking.client`` and ``raydeck.tracking.proxy`` as two nodes, say). Exit 1 with each
cycle and the imports that make it.

Run: ``.venv/bin/python .ci/import_cycles.py`` (with the package installed, or
``PYTHONPATH=platform``).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping

import grimp

PACKAGE = "raydeck"


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The components of more than one node, or of one that imports itself (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def squashed(edges: Mapping[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph with every module named by its first ``depth`` parts below the package; an
    import within one such package is no edge."""
    def name(module: str) -> str:
        return ".".join(module.split(".")[: depth + 1])

    graph: dict[str, set[str]] = defaultdict(set)
    for importer, imported in edges.items():
        for target in imported:
            if name(importer) != name(target):
                graph[name(importer)].add(name(target))
    return graph


def main() -> int:
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    edges = {module: {target for target in graph.find_modules_directly_imported_by(module)
                      if target.split(".")[0] == PACKAGE}
             for module in graph.modules}
    depth_max = max(module.count(".") for module in edges)
    failures = 0
    for depth in [None, *range(1, depth_max)]:
        level = edges if depth is None else squashed(edges, depth)
        for component in strongly_connected(level):
            failures += 1
            where = "modules" if depth is None else f"packages at depth {depth}"
            print(f"import cycle among {where}: {', '.join(component)}")
            members = set(component)
            for importer in component:
                for target in sorted(level.get(importer, set()) & members):
                    print(f"    {importer} -> {target}")
    print(f"{len(edges)} modules; {failures} import cycle(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
