"""A bounded-rate per-token sample of the rollout/trainer mismatch, for ``pdm-lab calibrate --from-run``.

Before the first optimiser step of each batch (π = the weights that produced μ, up to the
engine's rounding), every ``1/RATE``-th response token — at most ``MAX_PER_STEP`` per step — is
appended to ``run_dir/mismatch_sample.jsonl`` as ``{"step", "d", "mu_tail", "pi_tail", "r",
"adv"}``: the top-K KL D, the tail masses μ_T and π_T, the ratio r and Â. The toys' calibration
table is then computed from the same fields (``envs.calibrate.run_table``), so a toy can be set
to this engine's regime. Only the main rank writes; the sample is a fixed stride, no RNG.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

RATE = 64
"""one token in RATE is kept."""
MAX_PER_STEP = 256
"""at most this many tokens per step."""


class MismatchSample:
    """Appends the per-token sample; ``enabled=False`` (non-main ranks) makes it a no-op."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True):
        self.path = Path(run_dir) / "mismatch_sample.jsonl"
        self.enabled = enabled

    @torch.no_grad()
    def write(self, step: int, stats, advantages: Tensor, response_mask: Tensor) -> int:
        """Sample one batch's tokens (stats: the core's ``TokenStats`` over [N] rows). Returns the
        number of rows written."""
        if not self.enabled:
            return 0
        idx = torch.nonzero(response_mask.reshape(-1).bool())[:, 0][::RATE][:MAX_PER_STEP]
        cols = {"d": stats.topk_kl, "mu_tail": stats.mu_tail, "pi_tail": stats.pi_tail, "r": stats.ratio,
                "adv": advantages.reshape(-1)}
        values = {k: v.detach().reshape(-1)[idx].double().cpu().tolist() for k, v in cols.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for i in range(idx.numel()):
                f.write(json.dumps({"step": step, **{k: values[k][i] for k in cols}}) + "\n")
        return int(idx.numel())
