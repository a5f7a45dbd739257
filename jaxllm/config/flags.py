"""The machinery that turns a config dataclass's field declarations into everything else: its
type checks (`check_types`), its JSON-text fields (`parse_json_field`), its command-line flags
(`add_dataclass_args`, read back by `from_cli_args`) and their `--help` (`field_docs`, the
docstring under each field). `option` declares what a flag needs beyond the field: vLLM's
spelling as an alias, and the choices.

It knows no config in particular: `jaxllm.config.engine` applies it to the engine's sections
(`add_cli_args`), `server.cli` to the server's own settings (`server.config.ServerConfig`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import textwrap
import types
import typing
from typing import Any


def option(default: Any, *aliases: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field with a default, the flag's other spellings (`aliases`) and its `choices`."""
    return dataclasses.field(default=default, metadata={"aliases": aliases, "choices": choices})


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """A class's annotations, resolved (the config modules postpone them), once per class."""
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under a dataclass's fields (a string literal right after the field),
    read from its source as Sphinx reads them."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs = {}
    for a, b in itertools.pairwise(tree.body[0].body):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = " ".join(inspect.cleandoc(b.value.value).split())
    return docs


def json_section(cls: type, value: Any, name: str) -> Any:
    """A dataclass `cls` from a flag's JSON object (or a dict; None and `cls` pass through),
    checked by its `check()`: vLLM's JSON configs (`--kv-events-config`, ...). A clear error
    names `name` and any unknown field."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{name}: unknown fields {unknown}; known: {sorted(names)}")
    config = cls(**value)
    config.check()
    return config


def parse_json_field(config: Any, name: str) -> None:
    """A dict field given as JSON text (as its flag takes it), parsed in place."""
    value = getattr(config, name)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
        object.__setattr__(config, name, parsed)


def check_types(config: Any) -> None:
    """A clear error naming the parameter for a value of the wrong type (a string where a
    number belongs, a bool for an int, ...), before any comparison trips over it, or outside
    the field's `choices`."""
    hints = type_hints(type(config))
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        ok = any(
            (value is None and t is type(None))
            or (t is bool and isinstance(value, bool))
            or (t is int and isinstance(value, int) and not isinstance(value, bool))
            or (t is float and isinstance(value, int | float) and not isinstance(value, bool))
            or (t is str and isinstance(value, str))
            or (t is dict and isinstance(value, dict))
            or (
                typing.get_origin(t) is tuple
                and isinstance(value, tuple)
                and all(isinstance(v, typing.get_args(t)[0]) for v in value)
            )
            for t in allowed
        )
        if not ok:
            want = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {want}, got {value!r}")
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            want = " or ".join(choices) if len(choices) == 2 else f"one of {', '.join(choices)}"
            raise ValueError(f"{f.name} must be {want}, got {value!r}")


def _cli_value(hint: Any):
    """argparse's `type` for a field: its type, with "none" for None where None is allowed."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    base = next(t for t in allowed if t is not type(None))
    if typing.get_origin(base) is tuple:  # one or more values (`nargs="+"`)
        base = typing.get_args(base)[0]
    if base is dict:  # JSON text, parsed by the section
        base = str
    if type(None) not in allowed:
        return base

    def parse(text: str):
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its errors
    return parse


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()
) -> None:
    """Adds a flag per field of the dataclass `cls`: `--max-num-seqs` for `max_num_seqs`,
    bools as `--x/--no-x`, tuples as one or more values, `option`'s aliases (vLLM's names) and
    choices, the field's docstring as help. `from_cli_args` reads them back."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint, doc = type_hints(cls)[f.name], field_docs(cls).get(f.name, "")
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = f.default
        if hint is bool:
            shown = "on" if default else "off"
            kind = {"action": argparse.BooleanOptionalAction}
        else:
            shown = default
            choices = f.metadata.get("choices")
            kind = {"dest": f.name, "type": _cli_value(hint), "choices": choices}
            allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            if any(typing.get_origin(t) is tuple for t in allowed):
                kind["nargs"] = "+"
        help_text = doc if default is None else f"{doc} (default: {shown})"
        parser.add_argument(*flags, default=default, help=help_text.replace("%", "%%"), **kind)


def from_cli_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The dataclass `cls` from a command line `add_dataclass_args` made the flags of (lists
    of values become tuples)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**{**values, **overrides})
