"""TOML configuration parsed into typed dataclasses, in one place.

Every key has a default and a one-line doc (field metadata) from which the config
reference is generated. Unknown keys, wrong types and missing required keys are
errors that name the key, so a typo never silently falls back to a default.

Keys declared with `env=True` (every path, and the free-form option tables a task
reads paths from) may use environment variables: `${VAR}` is replaced by VAR's value,
`${VAR:-default}` by the default when VAR is unset or empty, and `$$` is a literal
`$`. An unset variable without a default is an error naming the key and the
variable, so one config serves a pod (paths from its env), a systemd unit
(`Environment=`/`EnvironmentFile=`) and a laptop (the defaults).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union

import tomllib

from fedtrain.errors import ConfigError

T = TypeVar("T")
REQUIRED: Any = dataclasses.MISSING


def option(default: Any = REQUIRED, doc: str = "", *, env: bool = False, **kwargs: Any) -> Any:
    """A config key with its documentation (mutable defaults are copied per instance);
    `env=True`: `${VAR}` in its string values is expanded (see the module docstring)."""
    meta = {"doc": doc, "env": env}
    if isinstance(default, dict | list):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta, **kwargs)


def section(cls: type[T], doc: str = "") -> Any:
    """A nested table, defaulting to the section's own defaults."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc})


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a parsed TOML table, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key {_key(where, unknown[0])}; known keys here: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, f in fields.items():
        key = _key(where, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key {key}")
            continue
        value = data[name]
        if f.metadata.get("env"):
            value = expand_env(value, key)
        values[name] = _convert(hints[name], value, key)
    return cls(**values)


_ENV_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: Any, key: str, environ: typing.Mapping[str, str] | None = None) -> Any:
    """`value` with `${VAR}`, `${VAR:-default}` and `$$` expanded in every string it holds
    (tables and lists are walked); an unset variable without a default names `key`."""
    env = os.environ if environ is None else environ
    if isinstance(value, dict):
        return {k: expand_env(v, f"{key}.{k}", env) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, f"{key}[{i}]", env) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name is None:
            return "$"
        found = env.get(name)
        if default is not None:  # `:-`: the default when unset or empty, as in the shell
            return found or default
        if found is not None:
            return found
        raise ConfigError(
            f"{key} = {value!r} uses ${{{name}}}, but the environment variable {name} is not "
            f"set; set it, or write ${{{name}:-default}} to fall back to a default"
        )

    return _ENV_REFERENCE.sub(substitute, value)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key} = {value!r} should be {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        # A table may accept a scalar shorthand (e.g. `secagg = true`) via `from_scalar`.
        shorthand = getattr(tp, "from_scalar", None)
        if shorthand is not None and not isinstance(value, dict):
            value = shorthand(value, key)
        return from_dict(tp, value, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} should be a table, got {value!r}")
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {k: _convert(val_tp, v, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} should be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key} = {value!r} should be one of {list(typing.get_args(tp))}")
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r} should be {tp.__name__}, not a boolean")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key} = {value!r} should be {tp.__name__}, not {type(value).__name__}")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def reference(cls: type, where: str = "") -> list[str]:
    """Markdown lines documenting every key of a config dataclass (for docs and tests).

    A table of tables (`dict[str, SomeDataclass]`, e.g. `client_schedule`) gets its
    own row, then its entries' keys as `client_schedule.KEY.decay` and so on.
    """
    lines: list[str] = []
    hints = typing.get_type_hints(cls)
    nested: list[tuple[str, type]] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = _key(where, f.name)
        if dataclasses.is_dataclass(tp):
            nested.append((key, tp))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        doc = f.metadata.get("doc", "")
        kind = _type_name(tp) + (" (`${VAR}`)" if f.metadata.get("env") else "")
        lines.append(f"| `{key}` | {kind} | `{default}` | {doc} |")
        entry = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if dataclasses.is_dataclass(entry):
            nested.append((f"{key}.KEY", entry))  # type: ignore[arg-type]
    for key, tp in nested:
        lines.extend(reference(tp, key))
    return lines
