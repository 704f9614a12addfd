"""The one way every command turns its command line into settings.

A command's settings are a dataclass (see :mod:`openalign.cli.schema`). :func:`add_config` gives its
parser ``--config FILE`` (YAML), ``--print-config`` and one flag per field: ``--key`` for a top-level
field (``--batch-size`` or ``--batch_size``), ``--section.key`` for a nested one (``--ann.nprobe 8``,
``--train.run_dir runs/x``). Values are YAML scalars (``null``, ``1e-3``, ``[a, b]``); a top-level bool
is a switch (``--bf16`` / ``--no-bf16``, listed together, the help saying what ``--bf16`` does). Only the
flags actually given are applied, in order, on top of the YAML file, and the result goes through the
command's strict loader (``openalign.config.from_dict``), so an unknown key or an ill-typed value is a
one-line error naming the field. Short flags users type most are :class:`Alias` es of fields; an alias of a
top-level field replaces the field's own flag (one flag per setting), while a nested field keeps
``--section.key`` beside its shorthand.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openalign.cli.schema import NO_DEFAULT, Knob, Schema
from openalign.config import ConfigError, parse_yaml

OVERRIDES = "config_overrides"  # namespace attribute: [(dotted path, value), ...] in command-line order


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose arguments may be added on first use (so ``openalign --help`` reads no
    config), that accepts ``--a_b`` for ``--a-b``, and that turns an unknown ``--key`` into a one-line
    error listing the valid keys when it carries a config."""

    def __init__(self, *args: Any, build: Callable[[Parser], None] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._build = build
        self.schema: Schema | None = None
        self.replaced: dict[str, str] = {}  # a field's own flag -> the alias that stands for it

    def ensure_built(self) -> Parser:
        if self._build is not None:
            build, self._build = self._build, None
            build(self)
        return self

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self.ensure_built()
        args = list(sys.argv[1:] if args is None else args)
        if self.schema is not None:
            args = self._normalise(args)
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.ensure_built()
        return super().format_help()

    def _normalise(self, args: list[str]) -> list[str]:
        known = self._option_string_actions
        out: list[str] = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + args[i:]
            if arg.startswith("--") and len(arg) > 2:
                flag, eq, value = arg.partition("=")
                if flag not in known:
                    dashed = flag.replace("_", "-")
                    if dashed in self.replaced:
                        raise ConfigError(f"unknown option {flag}: this command spells it {self.replaced[dashed]}")
                    if "." not in flag and dashed in known:
                        flag = dashed
                    elif flag.replace("-", "_") in known:
                        flag = flag.replace("-", "_")
                    else:
                        raise ConfigError(_unknown(self.schema, flag[2:]))  # type: ignore[arg-type]
                arg = flag + eq + value
            out.append(arg)
        return out


def _unknown(schema: Schema, key: str) -> str:
    key = key.replace("-", "_")
    parent = key.rpartition(".")[0]
    while parent and not schema.is_section(parent):
        parent = parent.rpartition(".")[0]
    where = f" in {parent}" if parent else ""
    return f"unknown config key '{key}'; valid keys{where}: {', '.join(schema.valid_keys(parent))}"


def flag_of(path: str) -> str:
    """``--batch-size`` for a top-level field, ``--section.key`` (spelt as in YAML) for a nested one."""
    return f"--{path}" if "." in path else f"--{path.replace('_', '-')}"


def yaml_value(text: str) -> Any:
    """A flag's value read as a YAML scalar or flow collection (``null``, ``2e-3``, ``[a, b]``)."""
    try:
        return parse_yaml(text) if text != "" else ""
    except Exception as err:
        raise argparse.ArgumentTypeError(f"cannot parse {text!r}: {err}") from None


def str_value(text: str) -> str | None:
    """A string field keeps its text as typed (``--prefix 001``); ``null`` and ``~`` still mean None."""
    return None if text in ("null", "~", "None") else text


class _Set(argparse.Action):
    """Records (path, value) in the namespace's override list; ``const`` fixes the value (switches)."""

    def __init__(
        self, option_strings: list[str], dest: str, path: Any = "", fixed: Any = NO_DEFAULT, extend: bool = False,
        **kw: Any,
    ) -> None:  # fmt: skip
        if fixed is not NO_DEFAULT:
            kw["nargs"] = 0
        super().__init__(option_strings, dest, **kw)
        self.path, self.fixed, self.extend = path, fixed, extend

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        value = self.fixed if self.fixed is not NO_DEFAULT else values
        items = list(getattr(namespace, OVERRIDES, None) or [])
        if callable(self.path):
            items += list(self.path(value))
        elif self.extend:  # a repeated list flag adds to its earlier values
            earlier = [v for p, v in items if p == self.path]
            items = [(p, v) for p, v in items if p != self.path] + [
                (self.path, [*(earlier[-1] if earlier else []), *value])
            ]
        else:
            items.append((self.path, value))
        setattr(namespace, OVERRIDES, items)


class _Switch(_Set):
    """``--KEY`` sets the field true, ``--no-KEY`` false; the help (the field's comment) says what ``--KEY`` does."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, fixed=True, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        self.fixed = not (option_string or "").startswith("--no-")
        super().__call__(parser, namespace, values, option_string)


@dataclass(frozen=True)
class Alias:
    """A short flag for a field (``--engine`` for ``engine.engine``), a fixed value (``--channels-last``
    sets ``memory_format: channels_last``) or a converter (``--set KEY=VALUE``: ``to`` maps the value to
    (path, value) pairs)."""

    flags: tuple[str, ...]
    path: str | Callable[[Any], list[tuple[str, Any]]]
    help: str = ""
    value: Any = NO_DEFAULT  # a switch that sets this value
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    repeat: bool = False


def _describe(knob: Knob) -> str:
    text = knob.help
    if knob.default is not NO_DEFAULT and "default" not in text:
        shown = "none" if knob.default is None else knob.default
        if knob.kind == "bool" and "." not in knob.path and knob.default is not None:  # None: decided when run
            shown = "on" if knob.default else "off"
        text = f"{text} (default {shown})" if text else f"default {shown}"
    return text.replace("%", "%%")


def add_knob(parser: argparse.ArgumentParser | Any, knob: Knob) -> None:
    flag = flag_of(knob.path)
    text = _describe(knob)
    if knob.kind == "bool" and "." not in knob.path:  # a switch: --KEY, and --no-KEY beside it on the same line
        parser.add_argument(flag, "--no-" + flag[2:], action=_Switch, path=knob.path, dest=argparse.SUPPRESS,
                            help=text)  # fmt: skip
        return
    if knob.kind == "list" and "." not in knob.path:
        item = str_value if knob.item in (None, "str") else yaml_value  # list[float] items are numbers
        parser.add_argument(flag, action=_Set, path=knob.path, nargs="+", type=item, dest=argparse.SUPPRESS,
                            extend=True, metavar=knob.metavar or "VALUE", help=text)  # fmt: skip
        return
    metavar = knob.metavar or ("{" + ",".join(map(str, knob.choices)) + "}" if knob.choices else knob.kind.upper())
    convert = str_value if knob.kind == "str" else yaml_value
    parser.add_argument(flag, action=_Set, path=knob.path, type=convert, dest=argparse.SUPPRESS, metavar=metavar,
                        help=text)  # fmt: skip


def add_alias(parser: argparse.ArgumentParser | Any, alias: Alias) -> None:
    kw: dict[str, Any] = {"action": _Set, "path": alias.path, "dest": argparse.SUPPRESS, "help": alias.help}
    if alias.value is not NO_DEFAULT:
        kw["fixed"] = alias.value
    else:
        kw.update(type=alias.type or yaml_value, metavar=alias.metavar or "VALUE")
    parser.add_argument(*alias.flags, **kw)


def add_config(
    parser: Parser,
    schema: Schema,
    *,
    aliases: Sequence[Alias] = (),
    config_help: str = "YAML file of these settings (flags override it)",
    config_flag: bool = True,
) -> None:
    """``--config``, ``--print-config``, the aliases, then one flag per field (grouped by section)."""
    parser.schema = schema
    if parser.usage is None:  # the usage line names the command's own arguments, not every field
        formatter = parser._get_formatter()
        formatter.add_usage(None, parser._actions, [], prefix="")
        parser.usage = formatter.format_help().strip().replace("%", "%%") + " [--config FILE] [--KEY VALUE ...]"
    if config_flag:
        parser.add_argument("--config", metavar="FILE", help=config_help)
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings as YAML and exit")
    # An alias that stands for a top-level field (``--json`` for ``json_path``) is that field's one flag: it takes
    # the field's help when it has none, and the field's own spelling is an error that names the alias.
    fields = {k.path: k for k in schema.knobs if "." not in k.path}
    for alias in aliases:
        knob = fields.get(alias.path) if isinstance(alias.path, str) and alias.value is NO_DEFAULT else None
        if knob is not None:
            parser.replaced[flag_of(knob.path)] = alias.flags[-1]
            metavar = alias.metavar or knob.metavar or knob.kind.upper()
            alias = dataclasses.replace(alias, help=alias.help or _describe(knob), metavar=metavar)
        add_alias(parser, alias)
    groups: dict[str, Any] = {}
    top = parser.add_argument_group("settings (each one field of --config)")
    docs = {s.path: s.doc for s in schema.sections}
    for knob in schema.knobs:
        section = knob.path.rpartition(".")[0]
        if section and section not in groups:
            groups[section] = parser.add_argument_group(f"{section}: {docs.get(section, '')}".rstrip(": "))
        target = groups[section] if section else top
        if flag_of(knob.path) in parser._option_string_actions or flag_of(knob.path) in parser.replaced:
            continue
        add_knob(target, knob)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The fields set on the command line as {dotted path: value}, later flags winning."""
    out: dict[str, Any] = {}
    for path, value in getattr(args, OVERRIDES, None) or []:
        out.pop(path, None)
        out[path] = value
    return out


def base_data(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` YAML as a mapping (empty without one)."""
    from openalign.config import load_yaml

    path = getattr(args, "config", None)
    return load_yaml(path) if path else {}


def print_config(data: dict[str, Any]) -> None:
    import yaml

    print(yaml.safe_dump(data, sort_keys=False), end="")


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """{"ann.nprobe": 8} -> {"ann": {"nprobe": 8}}."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, last = path.split(".")
        node = out
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[last] = value
    return out


def data(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` YAML with the flags given on top."""
    from openalign.config import merge

    return merge(base_data(args), nested(overrides(args)))


def resolve(args: argparse.Namespace, load: Callable[[dict[str, Any]], Any]) -> Any:
    """``load(YAML merged with the flags)``: the command's strict loader builds and validates its config."""
    return load(data(args))
