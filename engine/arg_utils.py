"""The engine's command-line flags, made from EngineConfig as vLLM's EngineArgs.add_cli_args makes its own: a flag per
field, named as vLLM names it (the field's name, dashes for underscores; --x / --no-x for a bool), its type read off
the annotation (a JSON object for a dict), its choices the Literal the config checks, its default the field's and its
help the docstring under the field. Every `workbench` command and benchmark takes its engine flags from here."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import textwrap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import fields
from functools import cache
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from engine.config import EngineConfig

# the fields that have no flag, and why
NOT_FLAGS = {
    "token_script": "token ids per request id, or a Python callable: given from Python (LLM(token_script=...)), "
    "it has no command-line spelling",
}
# the spellings the workbench's commands had before they took vLLM's names, still understood
ALIASES = {"enable_prefix_caching": ("--no-prefix-caching",)}
# the namespace attribute that lists the fields add_engine_args gave the parser flags for
ENGINE_FIELDS = "_engine_fields"


def flag_name(field: str) -> str:
    """vLLM's flag of an EngineConfig field: --max-num-batched-tokens for max_num_batched_tokens."""
    return "--" + field.replace("_", "-")


@cache
def field_help() -> dict[str, str]:
    """Each EngineConfig field's help: the docstring under it in engine/config.py, on one line."""
    (cls,) = ast.parse(textwrap.dedent(inspect.getsource(EngineConfig))).body
    assert isinstance(cls, ast.ClassDef)
    docs = {}
    for node, after in zip(cls.body, cls.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object, as vLLM's --speculative-config '{"method": "ngram", ...}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _name_or_json_object(text: str) -> str | dict:
    """An argparse type: a JSON object where the text starts with '{', else a name."""
    return _json_object(text) if text.lstrip().startswith("{") else text


class _BooleanFlag(argparse.BooleanOptionalAction):
    """vLLM's --x / --no-x, and after them the old spellings of ALIASES (one that starts with --no- turns it off)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None, **kwargs: Any) -> None:
        flag, *aliases = option_strings
        # the help is set after: Python 3.11's BooleanOptionalAction would append a second "(default: ...)"
        super().__init__([flag], dest, **kwargs)
        self.option_strings = [*self.option_strings, *aliases]
        self.help = help


def _kind(name: str, hint: Any) -> dict[str, Any]:
    """add_argument's keywords for the field `name` of type `hint`: its action, or its type and choices."""
    union = get_origin(hint) in (Union, UnionType)  # int | None is a UnionType, Literal[...] | None a Union
    kinds = [a for a in get_args(hint) if a is not NoneType] if union else [hint]
    if kinds == [bool]:
        return {"action": _BooleanFlag}
    if len(kinds) == 1 and get_origin(kinds[0]) is Literal:
        return {"choices": get_args(kinds[0])}
    if len(kinds) == 1 and get_origin(kinds[0]) is list and get_origin(get_args(kinds[0])[0]) is Literal:
        return {"nargs": "+", "choices": get_args(get_args(kinds[0])[0])}  # vLLM's: --x a b, each one of the set
    if kinds in ([int], [float], [str]):
        return {"type": kinds[0]}
    if kinds == [dict]:
        return {"type": _json_object, "metavar": "JSON"}
    if kinds == [str, dict]:
        return {"type": _name_or_json_object, "metavar": "NAME|JSON"}
    raise TypeError(f"{name}: no command-line type for {hint} (give it one here, or name it in NOT_FLAGS)")


def _help(text: str, default: Any) -> str:
    shown = "" if default is None else f" (default: {json.dumps(default) if isinstance(default, dict) else default})"
    return (text + shown).replace("%", "%%")  # argparse formats help with %


def add_engine_args(
    parser: argparse.ArgumentParser,
    *,
    include: Sequence[str] | None = None,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    title: str = "engine (EngineConfig's fields, vLLM's flags)",
) -> None:
    """Add to `parser`, in an argument group, the flags of EngineConfig's fields: every one but NOT_FLAGS, or those
    of `include` in its order, less `exclude`. `defaults` overrides the engine's default of a field for this command;
    an override to None leaves the flag unset unless given (the engine's default applies, and what reads the
    namespace sees only what was given). engine_kwargs_from_args reads them back."""
    known = [f.name for f in fields(EngineConfig) if f.name not in NOT_FLAGS]
    names = known if include is None else list(include)
    unknown = [name for name in (*names, *exclude, *(defaults or {})) if name not in known]
    if unknown:
        raise ValueError(f"{unknown[0]}: not an EngineConfig field that has a flag (known: {', '.join(known)})")
    hints, helps, field_defaults = (
        get_type_hints(EngineConfig),
        field_help(),
        {f.name: f.default for f in fields(EngineConfig)},
    )
    group = parser.add_argument_group(title)
    added = [name for name in names if name not in exclude]
    for name in added:
        default = (defaults or {}).get(name, field_defaults[name])
        group.add_argument(
            flag_name(name),
            *ALIASES.get(name, ()),
            dest=name,
            default=default,
            help=_help(helps[name], field_defaults[name] if default is None else default),
            **_kind(name, hints[name]),
        )
    parser.set_defaults(**{ENGINE_FIELDS: (*(parser.get_default(ENGINE_FIELDS) or ()), *added)})


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields of the flags add_engine_args gave the parser of `args`, each with its value where it
    has one (None: not given, the engine's default applies): EngineConfig(**engine_kwargs_from_args(args)) is the
    engine the command line describes."""
    return {name: getattr(args, name) for name in getattr(args, ENGINE_FIELDS, ()) if getattr(args, name) is not None}
