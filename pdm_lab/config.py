"""Typed, frozen configuration dataclasses: the field checks every config uses.

``config_dataclass`` makes a frozen dataclass whose ``Annotated`` fields are range-checked;
``from_dict`` builds one from a mapping and refuses an unknown key, naming the key, where it was
found and the nearest valid key; ``to_dict`` is its inverse. The YAML grammar that reads configs
lives in ``pdm_lab.lab.yaml_config``; the core's ``MaskConfig`` in ``pdm_lab.mask_config``.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pdm_lab.errors import UserInputError

T = TypeVar("T")



class ConfigError(UserInputError, ValueError):
    """A config or command-line value that cannot be used: unknown key, wrong type, value out of
    range, a YAML file that does not parse. The command line prints it in one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed values of a numeric config field, as ``typing.Annotated`` metadata on the field:
    ``lr: Annotated[float, positive] = 1e-6``. On a tuple/list field it bounds every element.

    Every float field of a ``config_dataclass`` is also checked finite (NaN never passes; ±inf
    only with ``allow_inf``: a NaN δ would turn every δ-based mask off silently), and every int
    field must hold an int that fits in int64 (seeds and sizes reach torch), with or without a Range.
    """

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    allow_inf: bool = False

    def problem(self, value: float) -> str | None:
        """Why ``value`` is out of range, or None."""
        if value != value or (math.isinf(value) and not self.allow_inf):
            return "must be a finite number"
        if value < self.low or (self.low_open and value == self.low):
            return f"must be {'>' if self.low_open else '≥'} {self.low:g}"
        if value > self.high or (self.high_open and value == self.high):
            return f"must be {'<' if self.high_open else '≤'} {self.high:g}"
        return None


FINITE = Range()
positive = Range(low=0.0, low_open=True)
non_negative = Range(low=0.0)


@dataclasses.dataclass(frozen=True)
class Length:
    """Allowed lengths of a tuple/list config field, as ``typing.Annotated`` metadata beside any
    ``Range`` of its elements: ``rules: Annotated[tuple[str, ...], non_empty]`` (an empty grid
    axis would run nothing and report success)."""

    low: int = 1

    def problem(self, value: typing.Sized) -> str | None:
        if len(value) < self.low:
            return "must not be empty" if self.low == 1 else f"needs at least {self.low} entries"
        return None


non_empty = Length(1)


def at_least(low: float) -> Range:
    """Range [low, ∞)."""
    return Range(low=low)


def greater_than(low: float) -> Range:
    """Range (low, ∞)."""
    return Range(low=low, low_open=True)


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Range:
    """Range between low and high (closed unless ``low_open`` / ``high_open``)."""
    return Range(low=low, high=high, low_open=low_open, high_open=high_open)


def config_dataclass(section: str = "") -> typing.Callable[[type[T]], type[T]]:
    """``@dataclass(frozen=True)`` plus the field checks, run before the class's own
    ``__post_init__``: so a value is checked however the config is built (YAML, ``replace``,
    a CLI flag, a constructor call). ``section`` prefixes field names in errors (``mask.delta``)."""
    def wrap(cls: type[T]) -> type[T]:
        own = cls.__dict__.get("__post_init__")

        def __post_init__(self) -> None:
            check_fields(self)
            if own is not None:
                own(self)

        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
        cls.__config_section__ = section  # type: ignore[attr-defined]
        return dataclasses.dataclass(frozen=True)(cls)
    return wrap


def check_fields(instance: Any) -> None:
    """Type and range of every numeric field (``Range`` metadata; floats finite by default)."""
    cls = type(instance)
    section = getattr(cls, "__config_section__", "")
    hints = _extra_hints(cls)
    for f in dataclasses.fields(instance):
        where = f"{section}.{f.name}" if section else f.name
        _check_value(where, hints[f.name], getattr(instance, f.name), ())


_HINTS: dict[type, dict[str, Any]] = {}


def _extra_hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return _HINTS[cls]


def _at(where: str) -> str:
    """The prefix naming a value in an error: ``mask.delta: `` (none for a bare command-line value,
    which argparse names itself)."""
    return f"{where}: " if where else ""


def check_option(value: Any, *, integer: bool = False, rng: Range = FINITE,
                 field: tuple[type, str] | None = None) -> Any:
    """A command-line value, parsed by the config grammar, checked as a config field is: the
    number type (an integral ``1e5`` is an int), int64 for integers, then `rng`, or instead the
    type and ranges that config class `field[0]` declares on its field `field[1]`."""
    if field is not None:
        cls, name = field
        value = _convert("", typing.get_type_hints(cls)[name], value)
        _check_value("", _extra_hints(cls)[name], value, ())
        return value
    tp = int if integer else float
    value = _convert("", tp, value)
    _check_value("", tp, value, (rng,))
    return value


def _check_value(where: str, tp: Any, value: Any, ranges: tuple[Range, ...]) -> None:
    if typing.get_origin(tp) is typing.Annotated:
        base, *meta = typing.get_args(tp)
        if isinstance(value, (tuple, list)):
            for length in (m for m in meta if isinstance(m, Length)):
                why = length.problem(value)
                if why is not None:
                    raise ConfigError(f"{_at(where)}{why}, got {list(value)!r}")
        _check_value(where, base, value, ranges + tuple(m for m in meta if isinstance(m, Range)))
        return
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return
        numeric = [a for a in typing.get_args(tp) if a in (int, float) or typing.get_origin(a) is typing.Annotated]
        if len(numeric) == 1:
            _check_value(where, numeric[0], value, ranges)
        return
    if origin in (tuple, list) and isinstance(value, (tuple, list)):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        for i, item in enumerate(value):
            _check_value(f"{where}[{i}]", args[0] if args else Any, item, ranges)
        return
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{_at(where)}expected an integer, got {value!r}")
        if not -2 ** 63 <= value < 2 ** 63:  # compared as ints: float() of a huge int overflows
            raise ConfigError(f"{_at(where)}must fit in 64 bits (|value| < 2^63), got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{_at(where)}expected a number, got {value!r}")
    else:
        return
    for rng in ranges or (FINITE,):
        why = rng.problem(float(value))
        if why is not None:
            raise ConfigError(f"{_at(where)}{why}, got {value!r}")


def one_of(where: str, value: str, valid: typing.Iterable[str]) -> None:
    valid = sorted(valid)
    if value not in valid:
        near = difflib.get_close_matches(str(value), valid, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{_at(where)}unknown value {value!r}{hint} Valid: {', '.join(valid)}")


def _convert(where: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(where, arg, value)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: cannot convert {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, where=where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_at(where)}expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_convert(f"{where}[{i}]", item, v) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{_at(where)}expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{_at(where)}expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2.0 ** 53:
            value = int(value)  # 1e5 is the integer 100000 (exactly: below 2^53)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{_at(where)}expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{_at(where)}expected a number, got {value!r}")
        if isinstance(value, int) and abs(value) >= 2 ** 1024:
            raise ConfigError(f"{_at(where)}too large for a float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{_at(where)}expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], mapping: Any, where: str = "") -> T:
    """Build the dataclass `cls` from a mapping, recursively; unknown keys raise ``ConfigError``."""
    prefix = f"{where}." if where else ""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(mapping).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in mapping:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"unknown config key {prefix}{key!r}{hint} Valid keys: {', '.join(fields)}")
    kwargs = {key: _convert(f"{prefix}{key}", hints[key], value) for key, value in mapping.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as err:  # a required field without a value
        raise ConfigError(f"{where or cls.__name__}: {err}") from None
    except ValueError as err:  # a section's own validation (its __post_init__) refused the values
        raise ConfigError(f"{where}: {err}" if where else str(err)) from None


def to_dict(instance: Any) -> dict:
    """A plain dict (tuples become lists) suitable for ``yaml.safe_dump`` or JSON."""
    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value
    return plain(dataclasses.asdict(instance))
