"""The machinery behind typed configs: fields carrying their own help and limits, and what is done with them.

A config is a tree of dataclasses whose leaves are made with `option` and whose branches with `section`.
From the field metadata alone this module validates values, parses `--section.key=value` text, suggests the
key meant when one is misspelt, writes TOML back, and renders the Markdown reference; `megascale.config`
holds the job's own sections. Kept apart so that the sections read as a plain list of settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Any, cast

from megascale.errors import ConfigError


def option(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A config field: its default, one-line help, and the values it accepts."""
    metadata = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type) -> Any:
    """A nested config section (a dataclass) inside another one."""
    return field(default_factory=cls, metadata={"help": (cls.__doc__ or "").strip().splitlines()[0]})


def fail(key: str, value: Any, why: str) -> typing.NoReturn:
    """Raise the one-line ConfigError every config check uses: field, bad value, what is wrong."""
    raise ConfigError(f"config: {key} = {value!r} {why}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config class's resolved annotations (resolving them is slow, and they never change)."""
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def _base_type(tp: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of an annotation like `int | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        return args[0], True
    return tp, False


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_HOLDS = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "le": lambda v, b: v <= b,
    "lt": lambda v, b: v < b,
}


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check every leaf's type, choices and range (an int given for a float field becomes a float)."""
    hints = _hints(cast(type, type(obj)))  # cast: mypy does not take type[Any] as Hashable
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        if _is_section(hints[f.name]):
            check_fields(value, key + ".")
            continue
        base, optional = _base_type(hints[f.name])
        if value is None:
            if not optional:
                fail(key, value, "must be set")
            continue
        if base is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            setattr(obj, f.name, value)
        if not isinstance(value, base) or (base is int and isinstance(value, bool)):
            fail(key, value, f"must be of type {base.__name__}")
        meta = f.metadata
        if meta["choices"] and value not in meta["choices"]:
            fail(key, value, f"is not one of {', '.join(map(repr, meta['choices']))}")
        for name, symbol in _BOUNDS:
            if meta[name] is not None and not _HOLDS[name](value, meta[name]):
                fail(key, value, f"is out of range: must be {symbol} {meta[name]}")


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a config class, e.g. 'model.attention.window'."""
    keys = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            keys += leaf_keys(hints[f.name], prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def _unknown_key(root: type, key: str) -> typing.NoReturn:
    known = leaf_keys(root)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf][:1]
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"config: unknown key '{key}'{hint}")


def _parse_scalar(key: str, text: str, tp: Any) -> Any:
    base, optional = _base_type(tp)
    if optional and text.lower() in ("none", "null", ""):
        return None
    try:
        if base is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(text)
            return lowered in ("true", "1", "yes", "on")
        return base(text)
    except ValueError:
        raise ConfigError(f"config: {key} = {text!r} is not a valid {base.__name__}") from None


def set_key(root: Any, key: str, value: Any, from_text: bool) -> None:
    """Set the dotted `key` of the config `root`; `from_text` parses `value` as a command-line string."""
    parts = key.split(".")
    obj = root
    for part in parts[:-1]:
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            _unknown_key(type(root), key)
        obj = getattr(obj, part)
    names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    if parts[-1] not in names:
        _unknown_key(type(root), key)
    tp = _hints(cast(type, type(obj)))[parts[-1]]
    if _is_section(tp):
        raise ConfigError(
            f"config: '{key}' is a section; set one of its keys, e.g. "
            f"'{key}.{dataclasses.fields(tp)[0].name}'"
        )
    setattr(obj, parts[-1], _parse_scalar(key, value, tp) if from_text else value)


def flatten_keys(table: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten_keys(value, prefix + key + "."))
        else:
            flat[prefix + key] = value
    return flat


def to_toml(cfg: Any) -> str:
    """A config as TOML (unset optional fields are written as comments)."""
    lines: list[str] = []

    def emit(obj: Any, prefix: str) -> None:
        hints = _hints(cast(type, type(obj)))
        scalars = [f for f in dataclasses.fields(obj) if not _is_section(hints[f.name])]
        if prefix and scalars:
            lines.append(f"\n[{prefix}]")
        for f in scalars:
            value = getattr(obj, f.name)
            if value is None:
                lines.append(f"# {f.name} = (unset)")
            elif isinstance(value, bool):
                lines.append(f"{f.name} = {str(value).lower()}")
            elif isinstance(value, str):
                lines.append(f'{f.name} = "{value}"')
            else:
                lines.append(f"{f.name} = {value!r}")
        for f in dataclasses.fields(obj):
            if _is_section(hints[f.name]):
                emit(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)

    emit(cfg, "")
    return "\n".join(lines).lstrip("\n") + "\n"


def render_reference(root: type, preamble: list[str]) -> str:
    """Markdown: `preamble`, then a table per section of `root`: each field's type, default and meaning."""
    out = list(preamble)

    def describe(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        out.extend(
            [
                f"## `[{prefix}]`",
                "",
                (cls.__doc__ or "").strip(),
                "",
                "| key | type | default | meaning |",
                "|---|---|---|---|",
            ]
        )
        subsections = []
        for f in dataclasses.fields(cls):
            if _is_section(hints[f.name]):
                subsections.append((hints[f.name], f"{prefix}.{f.name}"))
                continue
            base, optional = _base_type(hints[f.name])
            type_name = base.__name__ + (" or unset" if optional else "")
            meta = f.metadata
            extra = []
            if meta["choices"]:
                extra.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
            extra += [f"{symbol} {meta[name]}" for name, symbol in _BOUNDS if meta[name] is not None]
            help_text = meta["help"] + (f" ({'; '.join(extra)})" if extra else "")
            default = "unset" if f.default is None else f"`{f.default!r}`".replace("'", '"')
            if f.default is dataclasses.MISSING:
                default = f"`{cast(Callable[[], Any], f.default_factory)()!r}`"
            out.append(f"| `{f.name}` | {type_name} | {default} | {help_text} |")
        out.append("")
        for sub, sub_prefix in subsections:
            describe(sub, sub_prefix)

    for f in dataclasses.fields(root):
        describe(_hints(root)[f.name], f.name)
    return "\n".join(out).rstrip() + "\n"
