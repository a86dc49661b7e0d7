"""TRL step time with and without the PDM subclass on the tiny Qwen3, same process, same settings.

    .venv-trl/bin/python tests_frameworks/trl/bench_trl_step.py [--steps N] [--repeats R]

Prints the median seconds per optimizer step of plain ``GRPOTrainer`` (loss_type dapo), of
``PDMGRPOTrainer`` (rule pdm_topk, K = 20) and of ``PDMGRPOTrainer`` with the live audit on every
step (``LiveAuditConfig(every=1)``; HF generate, so μ = π and every audit is idle: one forward, no
snapshot), interleaved runs, their ratio, and the audit's median share of its step (its own
``pdm/time/audit_s``). Not a test: a measurement (no timed assertion anywhere)."""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import test_trl_trainer as t
    from pdm_lab import LiveAuditConfig, MaskConfig
    from pdm_lab.integrations.trl import PDMGRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], None

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "tiny"
        tiny.mkdir()
        t.build_tiny(tiny)
        audited = "PDMGRPOTrainer + idle audit every step"
        results = {"GRPOTrainer (dapo)": [], "PDMGRPOTrainer (pdm_topk, K=20)": [], audited: []}
        shares: list[float] = []
        for _ in range(args.repeats):
            for name in results:
                cfg = GRPOConfig(output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=8, num_generations=4,
                                 max_completion_length=32, max_steps=args.steps, learning_rate=1e-3, beta=0.0,
                                 temperature=1.0, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                 loss_type="dapo", logging_steps=1)
                timer = StepTimer()
                kwargs = dict(model=str(tiny), reward_funcs=t._reward, args=cfg, train_dataset=t._dataset(32),
                              callbacks=[timer])
                mask = MaskConfig(rule="pdm_topk", k=20)
                trainer = (PDMGRPOTrainer(**kwargs, mask=mask, audit=LiveAuditConfig(every=1, probe_tokens=8))
                           if name == audited else PDMGRPOTrainer(**kwargs, mask=mask) if name.startswith("PDM")
                           else GRPOTrainer(**kwargs))
                trainer.train()
                results[name].extend(timer.times[1:])  # first step: warm-up
                if name == audited:
                    audit_s = [e["pdm/time/audit_s"] for e in trainer.state.log_history if "pdm/time/audit_s" in e]
                    shares.extend(a / s for a, s in zip(audit_s[1:], timer.times[1:]))
        base = statistics.median(results["GRPOTrainer (dapo)"])
        for name, times in results.items():
            med = statistics.median(times)
            print(f"{name:40s} median {med * 1e3:8.1f} ms/step over {len(times)} steps  ratio {med / base:.3f}")
        if shares:
            print(f"idle audit's share of its step: median {statistics.median(shares):.3f} "
                  f"(range {min(shares):.3f} to {max(shares):.3f}, {len(shares)} steps)")


if __name__ == "__main__":
    main()
