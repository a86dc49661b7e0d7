"""Launch files for ``pdm-lab promote --target trl|verl``: a sweep's winning cell, ready to run there.

Input: the promoted pdm_lab run config (``scaling`` ``TrainConfig``: model, data, rollout and
trainer sections, the winning ``mask:`` and its ``provenance:``). Output:

* ``trl`` — a Python script building ``PDMGRPOTrainer`` with that ``MaskConfig`` and the run's
  model, data, group size, temperature, lengths and learning rate;
* ``verl`` — a bash script calling ``python -m verl.trainer.main_ppo`` with the plugin's loss
  (``pdm_lab.<rule>``, bypass mode) and the same settings as Hydra overrides. Rules that need
  μ's top-K (``support="topk"``) also turn on the top-K runtime patch set
  (``pdm_lab.integrations.verl_patches``): ``PDM_LAB_VERL_TOPK=K`` exported for a local Ray
  cluster and passed to every Ray worker through ``ray_kwargs.ray_init.runtime_env``, with
  processed log-probs (and vLLM's ``max_logprobs`` when K > 20). Rules that need inputs verl
  cannot give (``needs``: full distributions, the coupled direction) are refused. The engine's
  sampling mask (``rollout.keep_sampling_mask``, on by default when ``top_p``/``top_k`` cut) goes
  to the plugin loss as ``policy_loss.sampling_mask`` with the rollout's own ``top_k``/``top_p``,
  so π is renormalised over what vLLM could sample (``pdm_lab.sampling_mask``); it needs a top-K
  rule (a sampled-token loss sees only log π_k of the full softmax) and verl has no ``min_p``:
  either is refused in one line naming the key.

Both carry the provenance (sweep, cell, criterion, metrics, code version) and the evidence the
choice rests on (criterion value with its CI, the runner-up's, seeds, steps, regime, verdict) as
a header comment, and the provenance as data, so a run can be traced back to the toy result that
chose it and to how strongly it was chosen.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from pdm_lab.config import ConfigError, to_dict
from pdm_lab.mask_config import MaskConfig
from pdm_lab.masks import MASK_RULES

TARGETS = ("pdm", "trl", "verl")
#: The environment variable that turns on verl's top-K patch set in every process (value: K).
VERL_TOPK_ENV = "PDM_LAB_VERL_TOPK"
#: vLLM's default cap on ``logprobs`` per request.
VLLM_MAX_LOGPROBS = 20


def evidence_lines(prov: dict) -> list[str]:
    """What the promoted choice rests on, from ``provenance.metrics.evidence`` (written by
    ``promote``): criterion value with its CI, the runner-up's, seeds, steps, regime, verdict."""
    ev = (prov.get("metrics") or {}).get("evidence")
    if not isinstance(ev, dict):
        return ["evidence: not recorded (promoted before the evidence rule existed): treat as untested"]

    def est(e: Any) -> str:
        if not isinstance(e, dict) or e.get("mean") is None:
            return "n/a"
        lo, hi = e.get("ci95") or (None, None)
        ci = "no CI" if lo is None else f"95% CI [{lo:.3f}, {hi:.3f}]"
        return f"{e['mean']:.3f} ({ci}, {e.get('runs')} runs)"

    diff = ev.get("difference") or {}
    lo, hi = diff.get("ci95") or (None, None)
    lines = [f"evidence: {ev.get('criterion', '?')}",
             f"final reward of the chosen cell {ev.get('chosen_cell')}: {est(ev.get('chosen'))}; "
             f"seeds {ev.get('seeds')}, steps {ev.get('steps')}",
             f"runner-up {ev.get('runner_up_cell')}: {est(ev.get('runner_up'))}; difference "
             + ("n/a" if diff.get("mean") is None else f"{diff['mean']:+.3f}")
             + ("" if lo is None else f", 95% Welch CI [{lo:+.3f}, {hi:+.3f}]"),
             f"regime: {ev.get('regime')}"]
    problems = ev.get("problems") or []
    if not problems:
        lines.append("verdict: separated at 95%" if ev.get("runner_up_cell") is not None else
                     "verdict: the only never-collapsed cell (every other cell collapsed)")
    else:
        lines.append(("verdict: NOT evidence, promoted with --allow-tie: " if ev.get("allow_tie") else "verdict: ")
                     + "; ".join(problems))
    return lines


def _header(cfg: Any, comment: str) -> str:
    prov = dataclasses.asdict(cfg.provenance) if cfg.provenance is not None else {}
    lines = [f"promoted by `pdm-lab promote` from toy sweep {prov.get('sweep_dir', '?')}, cell {prov.get('cell_id', '?')}",
             f"criterion: {prov.get('criterion', '?')}", *evidence_lines(prov),
             f"code version: {prov.get('code_version', '?')}; created {prov.get('created', '?')}",
             "provenance: " + json.dumps(prov, sort_keys=True, default=str)]
    return "".join(f"{comment} {line}\n" for line in lines)


def trl_script(cfg: Any) -> str:
    """A runnable TRL script (Python) for the promoted run config `cfg`."""
    mask = to_dict(cfg.mask)
    data_files = list(cfg.data.train_files)
    kind = "parquet" if data_files and data_files[0].endswith(".parquet") else "json"
    ro, tr = cfg.rollout, cfg.trainer
    # one generation batch = the run's prompts × group, split into its mini-batches over the ranks
    per_device = max(1, ro.prompts_per_step * ro.group_size // tr.mini_batches // max(1, cfg.launch.nproc_per_node))
    prompt_column = cfg.data.prompt_key.split(".")[0]
    return f'''#!/usr/bin/env python
{_header(cfg, "#")}# Run: pip install 'pdm_lab[trl]'; accelerate launch THIS_FILE (add vLLM with use_vllm=True).
# The reward function is yours: replace `reward` below with your verifier.
from datasets import load_dataset
from trl import GRPOConfig

from pdm_lab import MaskConfig
from pdm_lab.integrations.trl import PDMGRPOTrainer

PROVENANCE = {json.dumps(dataclasses.asdict(cfg.provenance) if cfg.provenance else {}, sort_keys=True, default=str)!r}
MASK = MaskConfig(**{mask!r})


def reward(completions, **kwargs):
    raise NotImplementedError("plug in the run's verifier ({cfg.reward.verifier!r} in pdm_lab)")


if __name__ == "__main__":
    dataset = load_dataset({kind!r}, data_files={data_files!r}, split="train")
    if {prompt_column!r} != "prompt":
        dataset = dataset.rename_column({prompt_column!r}, "prompt")
    args = GRPOConfig(
        output_dir={f"runs/{cfg.name}-trl"!r},
        learning_rate={tr.lr!r},
        weight_decay={tr.weight_decay!r},
        num_generations={ro.group_size!r},
        temperature={ro.temperature!r},
        top_p={ro.top_p!r},
        max_completion_length={ro.max_tokens!r},
        per_device_train_batch_size={per_device!r},
        steps_per_generation={tr.mini_batches!r},
        num_iterations=1,
        max_steps={cfg.total_steps!r},
        beta=0.0,
        seed={cfg.seed!r},
    )
    trainer = PDMGRPOTrainer(model={str(cfg.model.path)!r}, reward_funcs=reward, args=args,
                             train_dataset=dataset, mask=MASK)
    trainer.train()
'''


def hydra_value(value: Any) -> str:
    """`value` in Hydra's override grammar (dict keys unquoted; JSON's quoted keys do not parse)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    raise TypeError(f"hydra_value: cannot write {type(value).__name__} {value!r}")


def verl_overrides(cfg: Any) -> list[str]:
    """Hydra overrides for ``verl.trainer.main_ppo`` (verl 0.9.1 names) for run config `cfg`."""
    mask: MaskConfig = cfg.mask
    record = MASK_RULES[mask.rule]
    if record.needs:
        raise ValueError(f"promote --target verl: rule {mask.rule!r} needs {', '.join(record.needs)} inputs, which "
                         "verl's rollout cannot give (its top-K patch set carries μ's top-K only)")
    section = {k: v for k, v in to_dict(mask).items() if k != "rule"}
    ro, tr = cfg.rollout, cfg.trainer
    agg = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
           "seq-mean-token-sum": "seq-mean-token-sum", "seq-mean-token-sum-norm": "seq-mean-token-sum-norm"}
    out = [
        f"data.train_files={json.dumps(list(cfg.data.train_files))}",
        f"data.prompt_key={cfg.data.prompt_key.split('.')[0]}",
        f"data.train_batch_size={ro.prompts_per_step}",
        f"data.max_prompt_length={cfg.data.max_prompt_tokens}",
        f"data.max_response_length={ro.max_tokens}",
        f"actor_rollout_ref.model.path={cfg.model.path}",
        f"actor_rollout_ref.rollout.n={ro.group_size}",
        f"actor_rollout_ref.rollout.temperature={ro.temperature}",
        f"actor_rollout_ref.rollout.top_p={ro.top_p}",
        f"actor_rollout_ref.rollout.top_k={ro.top_k}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.actor.optim.lr={tr.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, ro.prompts_per_step // tr.mini_batches)}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.loss_agg_mode={agg[mask.aggregation]}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.policy_loss._target_=pdm_lab.integrations.verl.PDMPolicyLossConfig",
        f"actor_rollout_ref.actor.policy_loss.loss_mode=pdm_lab.{mask.rule}",
        "+actor_rollout_ref.actor.policy_loss.mask=" + hydra_value(section),
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.rollout_is=null",
        f"trainer.total_training_steps={cfg.total_steps}",
        f"trainer.experiment_name={cfg.name}-pdm",
    ]
    if mask.horizon is not None:
        out.append(f"actor_rollout_ref.actor.loss_scale_factor={mask.horizon}")
    sampling = verl_sampling_mask(cfg)
    if sampling is not None:  # π over the engine's sampling set (pdm_lab.integrations.verl_config)
        out.append("+actor_rollout_ref.actor.policy_loss.sampling_mask=" + hydra_value(sampling))
    if record.support == "topk":  # μ's top-K from the rollout: pdm_lab.integrations.verl_patches
        out += [f'+ray_kwargs.ray_init.runtime_env.env_vars.{VERL_TOPK_ENV}="{mask.k}"',
                "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs"]
        if mask.k > VLLM_MAX_LOGPROBS:
            out.append(f"+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs={mask.k}")
    return out


def verl_sampling_mask(cfg: Any) -> dict | None:
    """``policy_loss.sampling_mask`` for run config `cfg`: the rollout's ``top_k``/``top_p`` when
    the engine's sampling mask is kept (``rollout.keep_sampling_mask``; None: whenever they cut),
    else None. ``min_p`` (verl's rollout has no such key) and a sampled-token rule (its loss cannot
    renormalise π) are refused with the key that turns the mask off."""
    ro = cfg.rollout
    if ro.keep_sampling_mask is False:
        return None
    if ro.min_p > 0:
        raise ConfigError(f"promote --target verl: rollout.min_p={ro.min_p}: verl's rollout has no min_p, so its "
                          "engine would not make that cut; set rollout.min_p=0")
    mask = ro.sampling_mask
    if mask is None:  # nothing cut
        return None
    if MASK_RULES[cfg.mask.rule].support != "topk":
        raise ConfigError(f"promote --target verl: rollout.keep_sampling_mask: rule {cfg.mask.rule!r} is a "
                          f"sampled-token rule, whose verl loss sees log π_k of the full softmax (no cut mass "
                          f"to renormalise by); use a top-K rule, or set rollout.keep_sampling_mask=false "
                          f"(top_p={ro.top_p}, top_k={ro.top_k} then count as mismatch)")
    return {"top_k": mask.top_k, "top_p": mask.top_p}


def verl_script(cfg: Any) -> str:
    """A runnable bash script launching verl with pdm_lab's plugin loss for run config `cfg`."""
    args = " \\\n    ".join(shlex.quote(o) for o in verl_overrides(cfg))
    topk = ""
    if MASK_RULES[cfg.mask.rule].support == "topk":
        topk = (f"# {cfg.mask.rule} reads μ's top-K: pdm_lab's verl top-K patch set (verl_patches) carries it from\n"
                f"# vLLM to the actor; it is applied in every process where {VERL_TOPK_ENV} is set.\n"
                f"export {VERL_TOPK_ENV}={cfg.mask.k}\n")
    return f'''#!/usr/bin/env bash
{_header(cfg, "#")}# Run: pip install 'pdm_lab[verl]' (the plugin registers through verl.plugins); then this file.
set -euo pipefail
{topk}python -m verl.trainer.main_ppo \\
    {args} \\
    "$@"
'''


def write_launch_file(target: str, cfg: Any, out: Path) -> Path:
    """Write the `target` launch file for the promoted run config `cfg` (loaded by the caller:
    the core imports no stage) to `out`."""
    if target not in ("trl", "verl"):
        raise ValueError(f"target: unknown {target!r}; valid: {', '.join(TARGETS)}")
    text = trl_script(cfg) if target == "trl" else verl_script(cfg)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    out.chmod(0o755)
    return out
