"""The layers of ARCHITECTURE.md, checked on every import in src/: a package imports only from its own
layer and the layers below it (imports inside functions count too)."""

from __future__ import annotations

import ast
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
