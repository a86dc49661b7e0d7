"""The one YAML grammar: config files, ``key.path=value`` overrides and numeric options.

Safe loading only, with YAML 1.2's numbers, so ``1e-5``, ``1E5`` and ``-2.5e+3`` are numbers (YAML
1.1, PyYAML's default, reads them as strings), ``010`` is ten, ``.nan``/``.inf`` parse and are then
refused by every field that must be finite. A duplicate key and an alias (``*name``, which can
expand a few lines into gigabytes) are errors at load time.
"""
from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pdm_lab.config import ConfigError, from_dict

T = TypeVar("T")


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


#: The largest config file read (a config is a few KB): ``/dev/zero`` or a log given by mistake
#: is refused after this many bytes instead of filling the memory.
MAX_CONFIG_BYTES = 4 << 20


def read_yaml(path: str | Path) -> Any:
    """A YAML file by ``ConfigLoader``'s grammar; every error names the file (and the line)."""
    with open(path, "rb") as fh:
        raw = fh.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
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
