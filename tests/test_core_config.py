"""Typed configs: YAML loading, unknown keys, nested dataclasses, overrides, the one numeric
grammar (files, overrides, options), field ranges, duplicate keys and aliases refused."""
import dataclasses
import math
import typing
from typing import Annotated

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from pdm_lab.config import ConfigError, at_least, check_option, config_dataclass, from_dict, non_empty, non_negative, to_dict
from pdm_lab.mask_config import MaskConfig
from pdm_lab.lab.yaml_config import apply_overrides, dump_yaml, load_yaml, parse_yaml, read_yaml


@dataclasses.dataclass(frozen=True)
class _Run:
    name: str = "x"
    steps: int = 3
    mask: MaskConfig = dataclasses.field(default_factory=MaskConfig)
    seeds: tuple[int, ...] = (0,)


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"name": "a", "mask": {"rule": "dppo_topk_kl", "delta": 0.05}, "seeds": [1, 2]}))
    cfg = load_yaml(_Run, path)
    assert cfg.mask.rule == "dppo_topk_kl" and cfg.mask.delta == 0.05 and cfg.seeds == (1, 2)
    assert from_dict(_Run, to_dict(cfg)) == cfg


def test_unknown_nested_key_names_path_and_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key mask\.'convension'; did you mean 'convention'"):
        from_dict(_Run, {"mask": {"convension": "kslot"}})


def test_wrong_types():
    with pytest.raises(ConfigError, match="steps: expected an integer"):
        from_dict(_Run, {"steps": "three"})
    with pytest.raises(ConfigError, match="mask.delta: expected a number"):
        from_dict(_Run, {"mask": {"delta": "big"}})


def test_overrides():
    raw = apply_overrides({"mask": {"rule": "none"}}, ["mask.delta=0.05", "steps=7", "mask.rule=pdm_topk"])
    cfg = from_dict(_Run, raw)
    assert cfg.steps == 7 and cfg.mask.delta == 0.05 and cfg.mask.rule == "pdm_topk"
    with pytest.raises(ConfigError):
        apply_overrides({}, ["novalue"])


def test_yaml_safe_load_only(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match=r"evil\.yaml.*python/object/apply:os\.system") as err:
        load_yaml(_Run, path)
    assert isinstance(err.value.__cause__, yaml.YAMLError)


_FINITE = st.floats(allow_nan=False, allow_infinity=False)


@given(x=_FINITE, style=st.sampled_from(["{:e}", "{:E}", "{!r}", "{:+.17e}"]))
def test_every_float_literal_is_a_number(x, style):
    """Law: a float written in any of Python's forms (``1e-05``, ``1E+05``, ``-2.5e+03``, ``0.1``)
    reads back as that float: in a file, an override and a command-line option alike."""
    from pdm_lab.cli.main import number

    text = style.format(x)
    assert parse_yaml(text) == float(text) and type(parse_yaml(text)) is float
    assert apply_overrides({}, [f"a.b={text}"])["a"]["b"] == float(text)
    assert number()(text) == float(text)


def test_pyyaml_default_grammar_fails_the_law():
    """The planted bug the law above catches: YAML 1.1 (PyYAML's default) reads these as strings."""
    assert all(isinstance(yaml.safe_load(t), str) for t in ("1e-5", "1E5", "-2e+3"))
    assert [parse_yaml(t) for t in ("1e-5", "1E5", "-2e+3")] == [1e-5, 1e5, -2000.0]


@given(n=st.integers(min_value=-2 ** 63, max_value=2 ** 63 - 1))
def test_every_int_literal_is_that_int(n):
    assert parse_yaml(str(n)) == n and type(parse_yaml(str(n))) is int


def test_yaml_12_scalars_not_11():
    assert parse_yaml("010") == 10 and parse_yaml("0x1f") == 31 and parse_yaml("1_000") == 1000
    assert [parse_yaml(t) for t in ("yes", "on", "1:30", "2026-12-02")] == ["yes", "on", "1:30", "2026-12-02"]
    assert parse_yaml("true") is True and math.isnan(parse_yaml(".nan")) and parse_yaml("-.inf") == -math.inf


_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=12)  # PyYAML folds NEL etc.
_SCALARS = st.one_of(_TEXT, _FINITE, st.integers(-2 ** 70, 2 ** 70), st.booleans(), st.none(),
                     st.sampled_from(["1e-5", "1E5", "010", "true", "yes", ".nan", "2026-12-02", "1:30", "~", ""]))


@settings(max_examples=200)
@given(doc=st.dictionaries(_TEXT.filter(bool), st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3))))
def test_dump_then_read_is_the_identity(doc):
    """What ``save_config`` writes reads back equal: a string that looks like a number stays a string."""
    assert parse_yaml(dump_yaml(doc)) == doc


def test_duplicate_key_names_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: a\nmask:\n  delta: 0.1\n  k: 5\n  delta: 0.2\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml: line 5: duplicate key 'delta' \(first at line 3\)"):
        load_yaml(_Run, path)


def test_aliases_are_refused_before_expansion(tmp_path):
    """A billion-laughs document: nine lines that expand to 9^9 entries. Refused at the first alias
    (the dry run then catches it), before anything is expanded or copied."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"bomb\.yaml: line 2: alias \*l0: YAML aliases are not allowed"):
        read_yaml(path)
    with pytest.raises(ConfigError, match="aliases"):
        parse_yaml("a: &x 1\nb: *x\n")
    assert "&" not in dump_yaml({"a": [1], "b": [1]}) and "*" not in dump_yaml({"a": (s := [1]), "b": s})


def test_deep_nesting_and_bad_bytes_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="nested deeper than"):
        parse_yaml("a: " + "[" * 3000 + "]" * 3000)
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8"):
        read_yaml(path)


@config_dataclass("grid")
class _Grid:
    ks: Annotated[tuple[int, ...], at_least(1), non_empty] = (20,)
    deltas: Annotated[tuple[float, ...], non_negative] = (0.15,)
    seed: int = 0


def test_field_checks_lengths_int64_and_integral_floats():
    assert from_dict(_Grid, {"ks": [1e2, 3]}).ks == (100, 3)  # 1e2 is the integer 100
    for doc, msg in (({"ks": []}, r"grid\.ks: must not be empty"), ({"ks": [0]}, r"grid\.ks\[0\]: must be ≥ 1"),
                     ({"ks": [2.5]}, r"ks\[0\]: expected an integer, got 2\.5"),
                     ({"seed": 2 ** 63}, r"grid\.seed: must fit in 64 bits"),
                     ({"seed": 1e20}, r"seed: expected an integer, got 1e\+20"),
                     ({"deltas": [float("nan")]}, r"grid\.deltas\[0\]: must be a finite number"),
                     ({"deltas": [10 ** 400]}, r"deltas\[0\]: too large for a float")):
        with pytest.raises(ConfigError, match=msg):
            from_dict(_Grid, doc)
    assert from_dict(_Grid, {"deltas": []}).deltas == ()  # no Length declared: empty is allowed


def test_mask_framework_ranges_live_on_the_fields():
    """dual_clip_c, veto_floor, opsm_delta carry their ranges in their annotations (declared once,
    so an option built from the field checks the same thing)."""
    hints = typing.get_type_hints(MaskConfig, include_extras=True)
    for name in ("dual_clip_c", "veto_floor", "opsm_delta"):
        assert "Range" in repr(hints[name]), name
    for name, bad in (("dual_clip_c", 1.0), ("veto_floor", 0.0), ("opsm_delta", -1e-9), ("opsm_delta", math.inf)):
        with pytest.raises(ConfigError, match=f"mask.{name}"):
            MaskConfig(**{name: bad})
        with pytest.raises(ConfigError):
            check_option(bad, field=(MaskConfig, name))
    assert check_option(1e-5, field=(MaskConfig, "delta")) == 1e-5


def test_overrides_refuse_bad_paths():
    for item, msg in (("=3", "empty key"), ("mask..delta=1", "empty key"), ("mask.delta.x=1", "mask.delta is a value")):
        with pytest.raises(ConfigError, match=msg):
            apply_overrides({"mask": {"delta": 0.1}}, [item])
    with pytest.raises(ConfigError, match=r"override 'mask\.delta=\[1': "):
        apply_overrides({}, ["mask.delta=[1"])


def test_section_validation_errors_become_config_errors():
    @config_dataclass("sec")
    class _Checked:
        n: int = 1

        def __post_init__(self):
            if self.n == 3:
                raise ValueError("n: three is not allowed")

    with pytest.raises(ConfigError, match="outer: n: three is not allowed"):
        from_dict(_Checked, {"n": 3}, where="outer")
