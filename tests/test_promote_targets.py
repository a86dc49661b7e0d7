"""``pdm-lab promote --target trl|verl``: the launch file carries the winning cell's mask, the run's
settings and the provenance; it parses as Python / bash; verl top-K rules turn on the top-K patch set,
and rules verl cannot feed are refused."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pdm_lab.cli.main import main
from pdm_lab.mask_config import MaskConfig
from pdm_lab.integrations.launch_files import verl_overrides
from pdm_lab.scaling.config import load_config

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "scaling" / "configs" / "qwen3-4b-base-dapo.yaml"


def _sweep(tmp_path, rule):
    from pdm_lab.lab.results import SweepRow, write_results

    base = SweepRow(cell_id="c_win", seed=0, problem="bandit", policy="tabular", rule=rule, delta=0.1, k=20,
                    convention="union", estimator=MaskConfig(rule=rule).direction_estimator, mismatch="none",
                    mismatch_kind="none", mismatch_strength=0.0, optimizer="adam", lr=0.05, steps=40, epochs=1,
                    minibatches=1, initial_reward=0.1, final_reward=0.8, collapsed=False, nonfinite=False,
                    realised_topk_kl_mean=0.0, realised_topk_kl_max=0.0, realised_full_kl_mean=0.0,
                    realised_full_kl_max=0.0, update_topk_kl_mean=0.0, mask_fraction=0.0, outside_fraction=0.0,
                    dir_disagree=float("nan"), unsafe_keep=0.2, shrink=0.8, unsafe_keep_count=10,
                    unsafe_count=2, shrink_count=8, wall_s=1.0)
    rows = [dataclasses.replace(base, seed=s, final_reward=0.8 + 0.01 * s) for s in range(3)]  # separated
    rows += [dataclasses.replace(base, cell_id="c_lose", rule="none", estimator="topk", seed=s,
                                 final_reward=0.1 + 0.01 * s) for s in range(3)]
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    write_results(sweep, rows)
    return sweep


def test_trl_target_writes_a_script_with_the_cells_mask(tmp_path, capsys):
    sweep = _sweep(tmp_path, "pdm_topk")
    out = tmp_path / "launch_trl.py"
    assert main(["promote", str(sweep), "--base", str(BASE), "--out", str(out), "--target", "trl"]) == 0
    text = out.read_text()
    tree = ast.parse(text)  # valid Python
    mask_call = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.targets[0].id == "MASK")
    fields = ast.literal_eval(mask_call.value.keywords[0].value)
    assert MaskConfig(**fields) == MaskConfig(rule="pdm_topk", delta=0.1, k=20, convention="union")
    assert "cell c_win" in text and "PDMGRPOTrainer" in text and "learning_rate=1e-06" in text
    assert "# final reward of the chosen cell c_win: 0.810 (95% CI [0.785, 0.835], 3 runs); seeds 3, steps [40]" in text
    assert "# runner-up c_lose: 0.110" in text and "# verdict: separated at 95%" in text
    assert "# regime: problem bandit, policy tabular, mismatch none, adam lr 0.05, 40 steps" in text
    run_cfg = load_config(Path(str(out) + ".pdm.yaml"))  # the pdm config beside it, same provenance
    assert run_cfg.provenance.cell_id == "c_win" and run_cfg.mask.rule == "pdm_topk"


def test_verl_target_writes_a_bash_script_with_the_plugin_loss(tmp_path):
    sweep = _sweep(tmp_path, "dppo_binary_kl")
    out = tmp_path / "launch_verl.sh"
    assert main(["promote", str(sweep), "--base", str(BASE), "--out", str(out), "--target", "verl"]) == 0
    text = out.read_text()
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0  # valid bash
    assert "loss_mode=pdm_lab.dppo_binary_kl" in text and "bypass_mode=true" in text
    assert "actor_rollout_ref.model.path=models/Qwen3-4B-Base" in text and "cell c_win" in text
    mask_arg = next(a for a in verl_overrides(load_config(Path(str(out) + ".pdm.yaml")))
                    if a.startswith("+actor_rollout_ref.actor.policy_loss.mask="))
    # Hydra's grammar (keys unquoted); tests_frameworks/verl composes it with verl's own config
    assert mask_arg.split("=", 1)[1].startswith("{delta:0.1,") and "convention:'union'" in mask_arg
    assert "PDM_LAB_VERL_TOPK" not in text  # a sampled-token rule needs no patch


def test_verl_target_turns_on_the_top_k_patch_set_for_top_k_rules(tmp_path):
    sweep = _sweep(tmp_path, "pdm_uniform")
    out = tmp_path / "launch_verl.sh"
    assert main(["promote", str(sweep), "--base", str(BASE), "--out", str(out), "--target", "verl"]) == 0
    text = out.read_text()
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    assert "\nexport PDM_LAB_VERL_TOPK=20\n" in text and "loss_mode=pdm_lab.pdm_uniform" in text
    overrides = verl_overrides(load_config(Path(str(out) + ".pdm.yaml")))
    assert '+ray_kwargs.ray_init.runtime_env.env_vars.PDM_LAB_VERL_TOPK="20"' in overrides
    assert "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs" in overrides
    assert not any("max_logprobs" in o for o in overrides)  # K = 20 is within vLLM's default cap
    mask_arg = next(a for a in overrides if a.startswith("+actor_rollout_ref.actor.policy_loss.mask="))
    assert ",k:20," in mask_arg


def test_verl_target_refuses_rules_verl_cannot_feed(tmp_path, capsys):
    sweep = _sweep(tmp_path, "pdm_exact")  # needs the full distributions
    out = tmp_path / "launch_verl.sh"
    assert main(["promote", str(sweep), "--base", str(BASE), "--out", str(out), "--target", "verl"]) != 0
    assert "full" in capsys.readouterr().err and not out.exists()
