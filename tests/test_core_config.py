"""Typed configs: YAML loading, unknown keys, nested dataclasses, overrides."""
import dataclasses

import pytest
import yaml

from pdm_lab.config import ConfigError, MaskConfig, apply_overrides, from_dict, load_yaml, to_dict


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
    with pytest.raises(yaml.YAMLError):
        load_yaml(_Run, path)
