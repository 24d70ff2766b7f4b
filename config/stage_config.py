"""A stage's config: a dataclass whose fields all have defaults and plain types, built from preset values.

The rules (checked when a plugin registers a stage, so a bad `Config` is the plugin's failure, not a traceback in a
run): a dataclass; every field has a default (a preset names only what it changes); each field's type is one of
bool, int, float, str or a list of one of them, or `Wrapped` (a wrapping stage's inner stage, see
h3gen.stages.base.Wrapper). Unknown keys and wrong types in a preset are errors that list what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any

from h3gen.errors import UsageError

PLAIN_TYPES = (bool, int, float, str)


def config_problem(config_cls) -> str:
    """Why `config_cls` breaks the rules above; '' when it keeps them."""
    from h3gen.stages.base import Wrapped

    if not dataclasses.is_dataclass(config_cls) or not isinstance(config_cls, type):
        return f"its Config {config_cls!r} is not a dataclass"
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception as e:  # a name in an annotation that does not resolve
        return f"its Config {config_cls.__qualname__} has an annotation that does not resolve ({e})"
    for field in dataclasses.fields(config_cls):
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            return f"its Config field '{field.name}' has no default"
        hint = hints[field.name]
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list and typing.get_args(hint) else None
        if hint not in PLAIN_TYPES + (Wrapped,) and item not in PLAIN_TYPES:
            return (f"its Config field '{field.name}' is {hint!r}: use bool, int, float, str or a list of one of "
                    "them")
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        try:
            if hint is not Wrapped:
                _coerce(default, hint, "", "")
        except UsageError:
            return f"its Config field '{field.name}' is {getattr(hint, '__name__', hint)} with the default {default!r}"
    return ""


def build_config(config_cls: type, values: dict[str, Any], where: str, set_as: dict[str, str] | None = None,
                 held: dict[str, str] | None = None, stage: str = ""):
    """Make a config dataclass from preset values: unknown keys and wrong types are errors listing what is allowed.
    `set_as` names the keys a --set gave ({"steps": "sampler.steps"}): their errors blame the --set, not `where`,
    and name the `stage` ("sampler stage 'euler'") that has no such key where given (a --set may have picked it);
    `held` names the section that holds a key where it is not `where` (a preset the asked one extends)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    set_as, held = set_as or {}, held or {}
    for key, value in values.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise UsageError(f"--set {set_as[key]}: unknown key '{key}' {f'for {stage}' if stage else f'in {where}'}"
                             if key in set_as
                             else f"unknown key '{key}' in {held.get(key, where)}",
                             f"allowed keys: {allowed}" if allowed else "this stage takes no keys")
        values[key] = _coerce(value, hints[key], f"--set {set_as[key]}" if key in set_as else
                              f"{held.get(key, where)}.{key}",
                              "fix the value after the =" if key in set_as else "fix the value in the preset or --set")
    try:
        return config_cls(**values)
    except UsageError as e:  # the config's own check (__post_init__): said where the first value it names was set
        key = next((k for k in values if re.search(rf"\b{k}\b", e.problem)), None)
        if key is None:
            raise
        raise UsageError(f"{f'--set {set_as[key]}' if key in set_as else held.get(key, where)}: {e.problem}",
                         e.fix) from None


def _coerce(value, hint, where: str, fix: str, within: str = ""):
    """`value` as `hint` takes it; `within` names the list an item is of ("a list of ")."""
    origin = typing.get_origin(hint) or hint
    if origin is float and isinstance(value, float) and math.isnan(value):  # every check's comparison passes it
        raise UsageError(f"{where} is nan, which is no number", fix)
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"{where} must be a list, got {value!r}", "write it as [a, b, ...]")
        (item,) = set(typing.get_args(hint)[:1]) or {object}
        return origin(_coerce(v, item, where, fix, "a list of ") for v in value)
    if origin is object or isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    raise UsageError(f"{where} must be {within}{getattr(origin, '__name__', origin)}, got "
                     f"{'the item ' if within else ''}{shown(value)}",
                     type_fix(origin, fix, value))


def shown(value) -> str:
    """A preset value as TOML writes it where it differs from Python (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def type_fix(kind, fix: str, value=None) -> str:
    """The fix for a value of the wrong type; for a bool, how TOML writes one (`yes`, `1` or `"true"` are not); for a
    string, the quotes that keep a word TOML reads as a number or a bool (`nan`, `inf`, `1`, `true`) a string."""
    if kind is bool:
        return f"write true or false, lowercase and unquoted; {fix}"
    if kind is str and isinstance(value, (bool, int, float)):
        word = shown(value)
        what = "a boolean" if isinstance(value, bool) else "a number"
        return f"{word} is read as {what}; quote it: \"{word}\" in a preset, '\"{word}\"' on the command line"
    return fix
