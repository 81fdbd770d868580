"""The package's shape: no module imports a higher layer, and no imports go round in a cycle.

Every import in `chainfuse/**/*.py` counts, also one inside a function or under TYPE_CHECKING. A
module's layer is its first component under `chainfuse/`; a new top-level module must be placed
in `LAYERS` deliberately. `chainfuse/__init__.py`, the public facade, sits above `ops`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import chainfuse

PACKAGE = Path(chainfuse.__file__).resolve().parent
FACADE = "chainfuse"

# lowest first; a module may import its own layer and the ones before it
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "ir builders hardware reference config gpu",
        "kernels",  # micro-kernels: their register block is an input of the model
        "model planner footprint simulate gpu_plan",
        "codegen",
        "runtime",
        "operands compiled compiler",
        "ops",
        FACADE,
        "torch cli bench __main__",
    )
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer_of(module: str) -> str:
    """`chainfuse.model.traffic` -> `model`; the facade is its own layer."""
    parts = module.split(".")
    return FACADE if len(parts) == 1 else parts[1]


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(target: str) -> str | None:
    """The module `target` (a dotted name under chainfuse) loads: itself, else the module of
    which it is a name (`chainfuse.ir.Chain` -> `chainfuse.ir`); None outside chainfuse."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def imports(module: str, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module of chainfuse) for every import in `module` (or in `source` read as if it
    were that module's), at any depth."""
    text = MODULES[module].read_text(encoding="utf-8") if source is None else source
    tree = ast.parse(text)
    package = module if _is_package(module) else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from P import n`: the submodule P.n where there is one, else P itself
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target == FACADE or target.startswith(FACADE + "."):
                resolved = _resolve(target)
                if resolved is not None and resolved != module:
                    found.append((node.lineno, resolved))
    return sorted(set(found))


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}"


def layering_violations() -> list[str]:
    """One line per import of a higher layer, and per module of no known layer."""
    problems = []
    for module in MODULES:
        layer = _layer_of(module)
        if layer not in LAYER:
            problems.append(f"{_where(module, 1)}: top-level module {layer!r} has no layer")
            continue
        for line, target in imports(module):
            other = _layer_of(target)
            if layer != FACADE and LAYER.get(other, -1) > LAYER[layer]:
                problems.append(f"{_where(module, line)}: {module} ({layer}) imports {target} "
                                f"({other}, a higher layer)")  # fmt: skip
    return problems


def import_cycles() -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan): each holds a cycle."""
    graph = {m: sorted({t for _, t in imports(m)}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in graph[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            group = []
            while True:
                t = stack.pop()
                on_stack.discard(t)
                group.append(t)
                if t == m:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in graph:
        if m not in index:
            visit(m)
    return groups


def _describe(group: list[str]) -> str:
    """The group's modules and every import that links two of them."""
    edges = [f"  {_where(m, line)}: {m} imports {t}" for m in group for line, t in imports(m)
             if t in group]  # fmt: skip
    return " <-> ".join(group) + "\n" + "\n".join(edges)


def test_no_module_imports_a_higher_layer() -> None:
    problems = layering_violations()
    assert not problems, "layering violated:\n" + "\n".join(problems)


def test_no_import_cycles() -> None:
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c) for c in cycles)


def test_the_reader_sees_imports_at_every_depth() -> None:
    """The reader itself: lazy imports inside functions and TYPE_CHECKING imports count, and
    relative and `from chainfuse import <name>` imports resolve to the module they load."""
    sources = {
        "chainfuse.runtime": "from . import cache\nfrom .cache import build\n",
        "chainfuse.ops": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import chainfuse.torch\n"
            "def f():\n    from chainfuse import ir, Chain\n"
        ),
    }
    read = {module: imports(module, source) for module, source in sources.items()}
    assert read["chainfuse.runtime"] == [
        (1, "chainfuse.runtime.cache"),
        (2, "chainfuse.runtime.cache"),
    ]
    assert sorted(read["chainfuse.ops"]) == [
        (3, "chainfuse.torch"),
        (5, "chainfuse"),
        (5, "chainfuse.ir"),
    ]
