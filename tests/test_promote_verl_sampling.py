"""``pdm-lab promote --target verl`` carries the engine's sampling mask: with a cut
(``rollout.top_p`` < 1 or ``top_k`` > 0) and ``rollout.keep_sampling_mask`` on (its default), the
launch file passes the rollout's ``top_k``/``top_p`` to verl's rollout and, under the key verl's
plugin loss reads (``policy_loss.sampling_mask``), the same cut the loop applies; off, or nothing
cut, no such key; a sampled-token rule or ``min_p`` (verl has none) is refused with exit 2 naming
the key."""
from __future__ import annotations

import ast
import subprocess
import types
from pathlib import Path

import pytest
import yaml

from pdm_lab.integrations.launch_files import verl_overrides
from pdm_lab.integrations.verl_config import sampling_setup
from pdm_lab.cli.main import main
from pdm_lab.scaling.config import load_config

from test_promote_targets import BASE, _sweep

KEY = "+actor_rollout_ref.actor.policy_loss.sampling_mask="


def _base(tmp_path: Path, **rollout) -> Path:
    raw = yaml.safe_load(BASE.read_text())
    raw["rollout"].update(rollout)
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _hydra_dict(text: str) -> dict:
    """Hydra's ``{a:1,b:0.5}`` (keys unquoted) back to a dict."""
    assert text.startswith("{") and text.endswith("}"), text
    return {k: ast.literal_eval(v) for k, v in (item.split(":", 1) for item in text[1:-1].split(","))}


def _cut(mask) -> tuple:
    """A sampling mask's cut (top_k 0 and −1 both mean off, as in vLLM)."""
    return max(mask.top_k, 0), mask.top_p, mask.min_p


def _promote(tmp_path: Path, rule: str, **rollout) -> tuple[int, Path]:
    sweep = _sweep(tmp_path, rule)
    out = tmp_path / "launch_verl.sh"
    code = main(["promote", str(sweep), "--base", str(_base(tmp_path, **rollout)), "--out", str(out),
                 "--target", "verl"])
    return code, out


@pytest.mark.parametrize("rollout", [{"top_p": 0.9}, {"top_k": 50}, {"top_p": 0.95, "top_k": 50},
                                     {"top_p": 0.9, "keep_sampling_mask": True}])
def test_verl_launch_file_carries_the_sampling_mask(tmp_path, rollout):
    code, out = _promote(tmp_path, "pdm_topk", **rollout)
    assert code == 0
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    run_cfg = load_config(Path(str(out) + ".pdm.yaml"))
    args = verl_overrides(run_cfg)
    text = out.read_text()
    arg = next(a for a in args if a.startswith(KEY))
    assert arg in text or repr(arg) in text or f"'{arg}'" in text
    section = _hydra_dict(arg[len(KEY):])
    assert set(section) == {"top_k", "top_p"}
    # the plugin loss reads it back as the very cut the loop applies to π
    loop_mask = run_cfg.rollout.sampling_mask
    assert loop_mask is not None
    verl_mask = sampling_setup(types.SimpleNamespace(policy_loss={"sampling_mask": section}))
    assert verl_mask is not None and _cut(verl_mask) == _cut(loop_mask)
    # and verl's engine samples with the same cut
    assert f"actor_rollout_ref.rollout.top_p={run_cfg.rollout.top_p}" in args
    assert f"actor_rollout_ref.rollout.top_k={run_cfg.rollout.top_k}" in args


@pytest.mark.parametrize("rollout", [{"top_p": 0.9, "keep_sampling_mask": False}, {}, {"top_p": 1.0, "top_k": -1}])
def test_no_sampling_mask_key_when_off_or_nothing_cut(tmp_path, rollout):
    code, out = _promote(tmp_path, "pdm_topk", **rollout)
    assert code == 0
    args = verl_overrides(load_config(Path(str(out) + ".pdm.yaml")))
    assert not any(a.startswith(KEY) for a in args) and "policy_loss.sampling_mask" not in out.read_text()
    assert f"actor_rollout_ref.rollout.top_p={rollout.get('top_p', 1.0)}" in args


@pytest.mark.parametrize("rule, rollout, key", [("dppo_binary_kl", {"top_p": 0.9}, "rollout.keep_sampling_mask"),
                                                ("pdm_topk", {"top_p": 0.9, "min_p": 0.05}, "rollout.min_p")])
def test_what_verl_cannot_do_is_refused_naming_the_key(tmp_path, capsys, rule, rollout, key):
    code, out = _promote(tmp_path, rule, **rollout)
    err = capsys.readouterr().err
    assert code == 2 and key in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_sampled_token_rule_without_the_mask_is_promoted(tmp_path):
    code, out = _promote(tmp_path, "dppo_binary_kl", top_p=0.9, keep_sampling_mask=False)
    assert code == 0 and "policy_loss.sampling_mask" not in out.read_text()
