"""The layers of ARCHITECTURE.md, checked on every import in src/: a package imports only from its own
layer and the layers below it (imports inside functions count too), and no modules import each other in a
circle."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "openalign"

# Bottom to top; the package __init__ (lazy public names) may reach every layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "outputs", "hardware", "process"),
    ("data",),
    ("text",),
    ("model",),
    ("loss", "optim", "embed"),
    ("eval", "search", "integrations"),
    ("train",),
    ("pipeline", "bench"),
    ("cli",),
)
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "openalign" and len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level openalign package) of every import in ``path``, relative ones resolved."""
    package = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, _top(a.name)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names = [module] if _top(module) else []
            if module == "openalign":  # from openalign import data
                names = [f"openalign.{a.name}" for a in node.names]
            found += [(node.lineno, _top(m)) for m in names]
    return [(line, top) for line, top in found if top]


def test_every_package_is_in_a_layer() -> None:
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if not p.name.startswith(("_", "."))}
    packages = {p for p in packages if (SRC / p).is_dir() or (SRC / f"{p}.py").is_file()}
    packages -= {"configs", "presets"}  # YAML, no code
    assert packages == set(LEVEL), f"add to LAYERS and ARCHITECTURE.md: {sorted(packages ^ set(LEVEL))}"


def test_no_import_climbs_a_layer() -> None:
    climbs = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        owner = rel.parts[0].removesuffix(".py")
        if owner == "__init__" or owner == "__main__":
            continue
        for line, target in _imports(path):
            if target in LEVEL and LEVEL[target] > LEVEL[owner]:
                climbs.append(f"{rel}:{line} ({owner}, layer {LEVEL[owner]}) imports {target} (layer {LEVEL[target]})")
    assert not climbs, "\n".join(climbs)


# ---------------------------------------------------------------------------------------------- circles


def _file(module: str) -> Path | None:
    """The file of the openalign module ``module`` (dotted): its package's ``__init__.py`` or its ``.py``."""
    if module.split(".")[0] != "openalign":
        return None
    path = SRC.parent.joinpath(*module.split("."))
    return next((f for f in (path / "__init__.py", path.with_suffix(".py")) if f.is_file()), None)


def _type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _absolute(node: ast.ImportFrom, package: tuple[str, ...]) -> str:
    if not node.level:
        return node.module or ""
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


@functools.cache
def _lazy_exports(init: Path) -> dict[str, str]:
    """The names a package's ``__init__.py`` exports lazily (PEP 562), each with the module defining it: what
    its ``if TYPE_CHECKING:`` block imports for type checkers."""
    package = init.relative_to(SRC.parent).parts[:-1]
    found = {}
    for stmt in ast.parse(init.read_text(encoding="utf-8")).body:
        if _type_checking(stmt):
            for node in ast.walk(stmt):
                if isinstance(node, ast.ImportFrom):
                    found |= {a.asname or a.name: _absolute(node, package) for a in node.names}
    return found


def _imported_files(path: Path) -> set[Path]:
    """The files of src/ that ``path`` imports: every import, at any depth (inside functions, under
    ``TYPE_CHECKING``), relative ones resolved. ``from openalign.pkg import name`` is ``pkg/name.py`` where
    that is a module, else the module ``pkg/__init__.py`` lazily exports ``name`` from, else
    ``pkg/__init__.py``; a package's own ``TYPE_CHECKING`` block (its lazy exports' names) imports nothing."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    lazy_names = [s for s in tree.body if _type_checking(s)] if path.name == "__init__.py" else []
    skipped = {id(node) for stmt in lazy_names for node in ast.walk(stmt)}
    found: set[Path | None] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {_file(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
            target = _file(module)
            if target is None or target.name != "__init__.py":
                found.add(target)
                continue
            lazy = _lazy_exports(target)
            found |= {_file(f"{module}.{a.name}") or _file(lazy.get(a.name, module)) for a in node.names}
    return {f for f in found if f is not None and f != path}


def _circles(graph: dict[Path, set[Path]]) -> list[tuple[Path, ...]]:
    """Every set of files that import each other in a circle, directly or through others, sorted."""
    reach = {}
    for start in graph:
        seen: set[Path] = set()
        todo = [start]
        while todo:
            new = graph.get(todo.pop(), set()) - seen
            seen |= new
            todo += new
        reach[start] = seen
    return sorted({tuple(sorted(f for f in reach[p] if p in reach[f])) for p in graph if p in reach[p]})


def test_no_import_circle() -> None:
    """No module imports one that imports it back, directly or through others, within a package or across."""
    graph = {path: _imported_files(path) for path in sorted(SRC.rglob("*.py"))}
    circles = [", ".join(str(f.relative_to(SRC)) for f in circle) for circle in _circles(graph)]
    assert not circles, "modules importing each other (move what they share down into a module of its own):\n" + (
        "\n".join(circles)
    )
