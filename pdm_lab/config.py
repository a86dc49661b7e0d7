"""Typed, frozen configuration dataclasses and the one YAML reader (safe loading only).

An unknown key is an error naming the key, where it was found, and the nearest valid key. The
``MaskConfig`` here is the ``mask:`` section of every config, toy sweep and full run alike.

One numeric grammar serves YAML files, ``key.path=value`` overrides and numeric command-line
options (``ConfigLoader``, ``parse_value``): YAML 1.2's numbers, so ``1e-5``, ``1E5`` and
``-2.5e+3`` are numbers (YAML 1.1, PyYAML's default, reads them as strings), ``010`` is ten,
``.nan``/``.inf`` parse and are then refused by every field that must be finite. A duplicate key
and an alias (``*name``, which can expand a few lines into gigabytes) are errors at load time.
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

import yaml

from .direction import DDOT_ESTIMATORS
from .masks import MASK_RULES, MaskRule
from .support import CONVENTIONS
from .errors import UserInputError

T = TypeVar("T")

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


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


@config_dataclass("mask")
class MaskConfig:
    """The trust-region mask and the policy loss (SPEC §4–5). Defaults follow the paper (§7)."""

    rule: str = "pdm_uniform"
    """Mask rule from the registry (``pdm_lab.masks.MASK_RULES``)."""
    delta: Annotated[float, non_negative] = 0.15
    """Trust-region threshold δ on the divergence (paper: 0.15, also 0.05)."""
    delta_neg: Annotated[float, non_negative] | None = None
    """Separate δ for Â < 0 (DPPO's code allows it); None: same as ``delta``."""
    k: Annotated[int, at_least(1)] = 20
    """K, how many of μ's top tokens the rollout exposes (paper: 20)."""
    convention: str = "union"
    """Support convention: ``union`` (paper, TopK ∪ {k}) or ``kslot`` (DPPO's public code)."""
    estimator: str | None = None
    """Ḋ estimator of the direction metrics; None: the rule's own (``MaskRule.estimator``), or
    ``topk`` (the exact derivative of the thresholded D) for rules without one."""
    eps_low: Annotated[float, non_negative] = 0.2
    """ppo_clip lower ε (GRPO clip-higher: 0.2)."""
    eps_high: Annotated[float, non_negative] = 0.28
    """ppo_clip upper ε (GRPO clip-higher: 0.28)."""
    icepop_low: Annotated[float, non_negative] = 0.5
    """icepop α: keep only r ≥ α."""
    icepop_high: Annotated[float, non_negative] = 2.0
    """icepop β: keep only r ≤ β."""
    clip_ratio_c: Annotated[float, positive] | None = None
    """TIS-style cap c on the ratio factor, sg(min(r, c)); None: no cap."""
    aggregation: str = "token-mean"
    """Loss aggregation (DAPO's token-mean by default)."""
    horizon: Annotated[int, at_least(1)] | None = None
    """Fixed horizon for ``seq-mean-token-sum-norm``; None: the padded response length."""
    # SPEC §4b: the rules frameworks ship (pdm_lab/framework_rules.py)
    dual_clip_c: Annotated[float, greater_than(1.0)] = 3.0
    """``ppo_clip_dual``: also drop Â<0 ∧ r > c (verl's dual-clip default: 3)."""
    seq_agg: str = "mean"
    """``seq_*`` rules: aggregate of the per-token statistic over a response (mean, max, sum)."""
    band_low: float | None = -0.02
    """``seq_*``/``token_k*`` rules: drop below this (None: no lower bound). ±0.02 suits all four
    statistics' scales (k1: geometric-mean ratio within e^±0.02; k2, k3, D are ≥ 0)."""
    band_high: float | None = 0.02
    """``seq_*``/``token_k*`` rules: drop above this (None: no upper bound)."""
    veto_floor: Annotated[float, positive] | None = None
    """Sequence rules: drop a response if any token has r below this (verl's veto; None: off)."""
    opsm_delta: Annotated[float, non_negative] = 1e-4
    """``opsm``: drop an Â<0 response whose mean log μ_k − log π_k exceeds this (slime: 1e-4)."""

    def __post_init__(self) -> None:
        one_of("mask.rule", self.rule, MASK_RULES)
        one_of("mask.convention", self.convention, CONVENTIONS)
        if self.estimator is not None:
            one_of("mask.estimator", self.estimator, DDOT_ESTIMATORS)
        one_of("mask.aggregation", self.aggregation, AGGREGATIONS)
        if self.icepop_high < self.icepop_low:
            raise ConfigError(f"mask.icepop_high ({self.icepop_high}) < icepop_low ({self.icepop_low})")
        _check_framework_fields(self)

    @property
    def delta_for_negative(self) -> float:
        return self.delta if self.delta_neg is None else self.delta_neg

    @property
    def rule_record(self) -> MaskRule:
        """The registry's record of ``rule`` (its divergence, estimator, what it reads)."""
        return MASK_RULES[self.rule]

    @property
    def direction_estimator(self) -> str:
        """The Ḋ estimator the direction metrics use: ``estimator``, else the rule's, else ``topk``."""
        return self.estimator or self.rule_record.estimator or "topk"


def _check_framework_fields(cfg: MaskConfig) -> None:
    from .framework_rules import BAND_RULES, SEQ_AGGREGATIONS

    one_of("mask.seq_agg", cfg.seq_agg, SEQ_AGGREGATIONS)
    if cfg.band_low is not None and cfg.band_high is not None and cfg.band_low > cfg.band_high:
        raise ConfigError(f"mask.band_low ({cfg.band_low}) > band_high ({cfg.band_high})")
    if cfg.rule in BAND_RULES and cfg.band_low is None and cfg.band_high is None:
        raise ConfigError(f"mask.rule {cfg.rule!r} rejects outside [band_low, band_high]: set at least one")


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


def load_yaml(cls: type[T], path: str | Path) -> T:
    """Load `cls` from a YAML file (``read_yaml``)."""
    return from_dict(cls, read_yaml(path))


# ---- the one YAML grammar ------------------------------------------------------------------

_FLOAT_TAG, _INT_TAG, _BOOL_TAG, _TIMESTAMP_TAG = (f"tag:yaml.org,2002:{t}" for t in ("float", "int", "bool",
                                                                                     "timestamp"))
#: YAML 1.2 core-schema floats: a dot or an exponent (its sign optional), or .inf / .nan.
_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                              |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                              |[0-9][0-9_]*[eE][-+]?[0-9]+
                              |\.(?:inf|Inf|INF))
                           |\.(?:nan|NaN|NAN))$""", re.X)
#: YAML 1.2 core-schema integers (decimal, 0x, 0o; ``_`` between digits as in Python): no
#: YAML 1.1 octal (``010`` = 8) or base 60 (``1:30`` = 90).
_INT_RE = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$")
#: YAML 1.2 booleans: no yes/no/on/off.
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
#: How deep a config may nest (the composer recurses; a config needs a handful of levels).
MAX_YAML_DEPTH = 64


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2's numbers and booleans (and no implicit dates: a
    timestamp stays a string), no duplicate keys, no aliases, bounded nesting. Errors are
    ``ConfigError`` naming the line (``parse_yaml`` adds the source)."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_FLOAT_TAG, _INT_TAG, _BOOL_TAG, _TIMESTAMP_TAG)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(f"line {event.start_mark.line + 1}: alias *{event.anchor}: YAML aliases are "
                              "not allowed in a config (a few lines of them expand to gigabytes); write "
                              "the value out")
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"line {mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, typing.Hashable) and key in seen:
                    raise ConfigError(f"line {line}: duplicate key {key!r} (first at line {seen[key]}); "
                                      "YAML would keep only the last value")
                if isinstance(key, typing.Hashable):
                    seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> int:
        text = self.construct_scalar(node).replace("_", "")
        sign = -1 if text.startswith("-") else 1
        digits = text.lstrip("+-")
        base = 16 if digits.startswith("0x") else 8 if digits.startswith("0o") else 10
        return sign * int(digits[2:] if base != 10 else digits, base)


ConfigLoader.add_implicit_resolver(_BOOL_TAG, _BOOL_RE, list("tTfF"))
ConfigLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))
ConfigLoader.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
ConfigLoader.add_constructor(_INT_TAG, ConfigLoader.construct_yaml_int)


class ConfigDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes by ``ConfigLoader``'s grammar (the string ``"1e-5"`` stays a
    string when read back) and never writes an alias (which ``ConfigLoader`` refuses)."""

    yaml_implicit_resolvers = ConfigLoader.yaml_implicit_resolvers

    def ignore_aliases(self, data: Any) -> bool:
        return True


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """One YAML document by ``ConfigLoader``'s grammar; errors are ``ConfigError`` naming `source`."""
    loader = ConfigLoader(text)
    loader.name = source  # marks (and so YAML's own messages) name the source
    try:
        return loader.get_single_data()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        flat = " ".join(part.strip() for part in str(err).splitlines() if part.strip())
        raise ConfigError(f"{source}: {flat}") from err
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> Any:
    """A YAML file by ``ConfigLoader``'s grammar; every error names the file (and the line)."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    return parse_yaml(text, source=str(path))


def dump_yaml(data: Any) -> str:
    """``data`` as YAML that ``read_yaml`` reads back equal (key order kept)."""
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=False, allow_unicode=True)


def parse_value(text: str, source: str = "value") -> Any:
    """A command-line value (an override's right-hand side, a numeric option) by the YAML grammar."""
    return parse_yaml(text, source=source)


def to_dict(instance: Any) -> dict:
    """A plain dict (tuples become lists) suitable for ``yaml.safe_dump`` or JSON."""
    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value
    return plain(dataclasses.asdict(instance))


def apply_overrides(mapping: dict, overrides: typing.Iterable[str]) -> dict:
    """``a.b=value`` strings onto a nested dict; values are YAML (``parse_value``: ``1e-5`` is a
    number, ``[a, b]`` a list)."""
    out = dict(mapping)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        path, raw = item.split("=", 1)
        keys = path.split(".")
        if not all(k.strip() for k in keys):
            raise ConfigError(f"override {item!r}: {path!r} is not a key.path (empty key)")
        node = out
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is not None and not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(keys[:depth + 1])} is a value "
                                  f"({child!r}), not a section")
            child = dict(child) if isinstance(child, dict) else {}
            node[key] = child
            node = child
        node[keys[-1]] = parse_value(raw, source=f"override {item!r}")
    return out
