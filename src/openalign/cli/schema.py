"""What a config dataclass looks like to the command line, read from its source file without importing it.

Every command's settings are a dataclass next to the library code they configure, each field written once
with its type, its default and a comment saying what it does. ``openalign CMD --help`` turns those
fields into flags; reading them with ``ast`` rather than importing the module keeps ``--help`` free of
torch (most of those modules import it). Running a command imports the real class and validates through
``openalign.config.from_dict``; ``tests/test_cli.py`` checks that what is read here matches the class.
"""

from __future__ import annotations

import ast
import functools
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parents[1]
NO_DEFAULT = object()  # a field without a default (required)
_SCALARS = {"bool", "int", "float", "str"}


@dataclass(frozen=True)
class Knob:
    """One config field as the command line sees it; ``path`` is its dotted key (``ann.nprobe``)."""

    path: str
    kind: str  # bool, int, float, str, list, dict or any
    default: Any = None  # NO_DEFAULT when the field has none
    help: str = ""
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    required: bool = False
    item: str | None = None  # a list's element kind, when the annotation names a scalar (list[float])


@dataclass(frozen=True)
class Section:
    """A nested dataclass field: its dotted path and its class docstring's first line."""

    path: str
    doc: str


@dataclass(frozen=True)
class Schema:
    knobs: tuple[Knob, ...]
    sections: tuple[Section, ...] = ()

    def valid_keys(self, parent: str = "") -> list[str]:
        """Keys directly under ``parent`` (the top level when empty)."""
        prefix = f"{parent}." if parent else ""
        names = {k.path[len(prefix) :].split(".")[0] for k in self.knobs if k.path.startswith(prefix)}
        names |= {s.path[len(prefix) :].split(".")[0] for s in self.sections if s.path.startswith(prefix)}
        return sorted(n for n in names if n)

    def is_section(self, path: str) -> bool:
        return any(s.path == path for s in self.sections)


# --------------------------------------------------------------------------------------------------
# Source files


def module_path(module: str) -> Path:
    """The source file of ``openalign.x.y`` (found on disk; importing it could pull in torch)."""
    parts = module.split(".")
    if parts[0] != "openalign":
        raise ValueError(f"{module}: only openalign modules are read from source")
    base = PACKAGE_DIR.joinpath(*parts[1:])
    path = base.with_suffix(".py")
    return path if path.is_file() else base / "__init__.py"


@functools.cache
def _parsed(module: str) -> tuple[ast.Module, dict[int, str], list[str]]:
    source = module_path(module).read_text()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    return ast.parse(source), comments, source.splitlines()


def _resolve(module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """Where ``name`` is defined, following ``from x import name``: (module, ClassDef or value node)."""
    if depth > 5:
        return None
    tree = _parsed(module)[0]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return module, node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return (module, node.value) if node.value is not None else None
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = node.module
                    if node.level:
                        base = module.split(".")[: -node.level]
                        source = ".".join([*base, node.module])
                    if source.startswith("openalign"):
                        return _resolve(source, alias.name, depth + 1)
    return None


def _value(module: str, node: ast.AST | None) -> Any:
    """A default's value: a literal, a module constant, or NO_DEFAULT when it cannot be read statically."""
    if node is None:
        return NO_DEFAULT
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        pass
    if isinstance(node, ast.Name):
        found = _resolve(module, node.id)
        if found and not isinstance(found[1], ast.ClassDef):
            return _value(*found)
    return NO_DEFAULT


def _class(module: str, node: ast.AST | None) -> tuple[str, ast.ClassDef] | None:
    """The dataclass an annotation or ``default_factory`` names, if any (``X`` or ``X | None``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _class(module, node.left) or _class(module, node.right)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _class(module, ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return None
    if isinstance(node, ast.Name):
        found = _resolve(module, node.id)
        if found and isinstance(found[1], ast.ClassDef):
            return found[0], found[1]
    return None


def _kind(module: str, node: ast.AST) -> tuple[str, tuple[Any, ...] | None]:
    """(kind, choices) of an annotation."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [p for p in (node.left, node.right) if not (isinstance(p, ast.Constant) and p.value is None)]
        return _kind(module, parts[0]) if len(parts) == 1 else ("any", None)
    if isinstance(node, ast.Name):
        if node.id in _SCALARS:
            return node.id, None
        found = _resolve(module, node.id)
        if found and not isinstance(found[1], ast.ClassDef):
            return _kind(*found)
        return "any", None
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value).split(".")[-1]
        if head == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return "str", tuple(ast.literal_eval(e) for e in elts)
        if head == "Optional":
            return _kind(module, node.slice)
        if head in ("tuple", "list", "Sequence"):
            return "list", None
        if head in ("dict", "Mapping"):
            return "dict", None
    return "any", None


def _comment(node: ast.stmt, comments: dict[int, str], lines: list[str]) -> str:
    """The comment lines right above a field plus the comment at the end of it, as one sentence."""
    above: list[str] = []
    line = node.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
        above.insert(0, comments.get(line, ""))
        line -= 1
    end = comments.get(node.end_lineno or node.lineno)
    return " ".join(p for p in [*above, end] if p)


def _docline(node: ast.ClassDef) -> str:
    doc = ast.get_docstring(node) or ""
    return doc.strip().split("\n")[0]


@functools.cache
def read(spec: str, prefix: str = "") -> Schema:
    """The fields of dataclass ``"openalign.module:Class"`` as knobs, nested dataclasses flattened to dotted
    paths under ``prefix``."""
    module, _, name = spec.partition(":")
    found = _resolve(module, name)
    if not found or not isinstance(found[1], ast.ClassDef):
        raise ValueError(f"{spec}: no such class")
    return _read_class(found[0], found[1], prefix)


def _read_class(module: str, cls: ast.ClassDef, prefix: str) -> Schema:
    _, comments, lines = _parsed(module)
    knobs: list[Knob] = []
    sections: list[Section] = []
    for base in cls.bases:  # a dataclass subclass: the base's fields come first, as in dataclasses.fields
        found = _class(module, base)
        if found is not None:
            inherited = _read_class(found[0], found[1], prefix)
            knobs += inherited.knobs
            sections += inherited.sections
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        if "ClassVar" in ast.unparse(stmt.annotation):
            continue
        name, value = stmt.target.id, stmt.value
        path = f"{prefix}{name}"
        factory: ast.AST | None = None
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
            kw = {k.arg: k.value for k in value.keywords}
            init = kw.get("init")
            if isinstance(init, ast.Constant) and init.value is False:
                continue
            factory, value = kw.get("default_factory"), kw.get("default")
        nested = _class(module, factory) or _class(module, stmt.annotation)
        if nested is not None:
            inner = _read_class(*nested, f"{path}.")
            sections.append(Section(path, _docline(nested[1])))
            knobs += inner.knobs
            sections += inner.sections
            continue
        if isinstance(factory, ast.Lambda):  # default_factory=lambda: ["a", "b"]: a literal, read as one
            try:
                default: Any = ast.literal_eval(factory.body)
            except ValueError:
                default = NO_DEFAULT
        elif factory is not None:
            default = {"dict": {}, "list": [], "tuple": ()}.get(ast.unparse(factory), NO_DEFAULT)
        else:
            default = _value(module, value)
        kind, choices = _kind(module, stmt.annotation)
        if isinstance(default, tuple):
            default = list(default)
        help_text, item = _comment(stmt, comments, lines), _item(module, stmt.annotation)
        knobs.append(Knob(path, kind, default, help_text, choices, required=stmt.value is None, item=item))
    by_path = {k.path: k for k in knobs}  # a field redefined in a subclass keeps its place and takes the new one
    return Schema(tuple(by_path.values()), tuple(sections))


# --------------------------------------------------------------------------------------------------
# Eval tasks: the Option declarations of ``openalign.eval`` modules, read the same way.


_OPTION_PARAMS = ("name", "type", "default", "help", "required", "choices", "metavar")
_TASK_PARAMS = ("name", "run", "help", "options", "examples", "description")


def _literal(module: str, node: ast.AST) -> Any:
    """A literal, a module constant, or ``list(CONSTANT)``; ValueError otherwise."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("list", "tuple") and len(node.args) == 1:
        return list(_literal(module, node.args[0]))
    value = _value(module, node)
    if value is NO_DEFAULT:
        raise ValueError(f"{module}: {ast.unparse(node)} is not a literal")
    return value


def _function(module: str, name: str) -> tuple[str, ast.FunctionDef] | None:
    """A function named ``name`` in ``module``, or imported into it (also inside a function body)."""
    tree = _parsed(module)[0]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return module, node
    for imp in ast.walk(tree):
        if (
            isinstance(imp, ast.ImportFrom)
            and imp.module
            and imp.module.startswith("openalign")
            and imp.module != module
            and any((a.asname or a.name) == name for a in imp.names)
        ):
            return _function(imp.module, name)
    return None


def _options(module: str, node: ast.AST) -> tuple[Knob, ...]:
    """A literal tuple of ``Option(...)``, where ``*f()`` splices the tuple that function ``f`` returns."""
    if not isinstance(node, ast.Tuple | ast.List):
        raise ValueError(f"{module}: options must be a literal tuple")
    out: list[Knob] = []
    for elt in node.elts:
        if isinstance(elt, ast.Starred) and isinstance(elt.value, ast.Call) and isinstance(elt.value.func, ast.Name):
            found = _function(module, elt.value.func.id)
            returns = [n for n in ast.walk(found[1]) if isinstance(n, ast.Return)] if found else []
            if len(returns) != 1 or returns[0].value is None:
                raise ValueError(f"{module}: cannot read {elt.value.func.id}()")
            out += _options(found[0], returns[0].value)  # type: ignore[index]
        else:
            out.append(_option(module, elt))
    return tuple(out)


def _item(module: str, node: ast.AST) -> str | None:
    """The scalar kind of a list annotation's elements (``list[float]`` → float), else None."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [p for p in (node.left, node.right) if not (isinstance(p, ast.Constant) and p.value is None)]
        return _item(module, parts[0]) if len(parts) == 1 else None
    if not isinstance(node, ast.Subscript) or ast.unparse(node.value).split(".")[-1] not in ("tuple", "list"):
        return None
    element = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
    kind, choices = _kind(module, element)
    return kind if kind in _SCALARS and not choices else None


def _call(node: ast.AST, params: tuple[str, ...], convert: Any) -> dict[str, Any]:
    if not isinstance(node, ast.Call):
        raise ValueError("not a call")
    out = {params[i]: convert(params[i], arg) for i, arg in enumerate(node.args)}
    out.update({k.arg: convert(k.arg, k.value) for k in node.keywords if k.arg})
    return out


def _option(module: str, node: ast.AST) -> Knob:
    def convert(param: str, value: ast.AST) -> Any:
        return ast.unparse(value) if param == "type" else _literal(module, value)

    o = _call(node, _OPTION_PARAMS, convert)
    kind = o.get("type", "str")
    if kind not in _SCALARS | {"list"}:
        raise ValueError(f"option type {kind}")
    choices = o.get("choices")
    return Knob(
        o["name"], kind, o.get("default"), o.get("help", ""), tuple(choices) if choices else None,
        o.get("metavar"), bool(o.get("required")),
    )  # fmt: skip


@dataclass(frozen=True)
class TaskInfo:
    name: str
    help: str
    options: tuple[Knob, ...]
    examples: tuple[str, ...] = ()
    description: str = ""


def _task(module: str, node: ast.AST) -> TaskInfo:
    def convert(param: str, value: ast.AST) -> Any:
        if param == "run":
            return None
        if param == "options":
            return _options(module, value)
        return _literal(module, value)

    t = _call(node, _TASK_PARAMS, convert)
    return TaskInfo(t["name"], t["help"], t.get("options", ()), tuple(t.get("examples", ())), t.get("description", ""))


@functools.cache
def eval_tasks() -> dict[str, TaskInfo]:
    """Every task a module of ``openalign.eval`` registers (``register(Task(...))``), with the common options
    appended. Raises ValueError when a declaration is more than literals, constants and option helpers."""
    tasks: dict[str, TaskInfo] = {}
    common: tuple[Knob, ...] = ()
    for stmt in _parsed("openalign.eval.tasks")[0].body:
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.target.id == "COMMON_OPTIONS"
            and stmt.value is not None
        ):
            common = _options("openalign.eval.tasks", stmt.value)
    for path in sorted((PACKAGE_DIR / "eval").glob("*.py")):
        if path.stem.startswith("_") or path.stem == "tasks":
            continue
        module = f"openalign.eval.{path.stem}"
        for node in ast.walk(_parsed(module)[0]):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "register" and node.args:
                info = _task(module, node.args[0])
                tasks[info.name] = TaskInfo(
                    info.name, info.help, info.options + common, info.examples, info.description
                )
    if not common:
        raise ValueError("openalign.eval.tasks: COMMON_OPTIONS not found")
    return tasks
