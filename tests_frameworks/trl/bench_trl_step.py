"""TRL step time with and without the PDM subclass on the tiny Qwen3, same process, same settings.

    .venv-trl/bin/python tests_frameworks/trl/bench_trl_step.py [--steps N] [--repeats R]

Prints the median seconds per optimizer step of plain ``GRPOTrainer`` (loss_type dapo), of
``PDMGRPOTrainer`` (rule pdm_topk, K = 20) and of ``PDMGRPOTrainer`` with the live audit on every
step (``LiveAuditConfig(every=1)``; HF generate, so μ = π and every audit is idle: read from the
loss's own D, no forward, no snapshot), interleaved runs, their ratio, and the audit's median share
of its step (its own ``pdm/time/audit_s``). A fourth arm audits a batch with outside tokens on every
step (the generator cuts at top-k 4 while the loss keeps the full softmax, δ 0.02: the test suite's
mismatch) and prints that audit's share of its step: snapshot, two rules and the momentum-only step
at one step size, the probe on 8 tokens. Not a test: a measurement (no timed assertion anywhere)."""
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
        audited, busy = "PDMGRPOTrainer + idle audit every step", "PDMGRPOTrainer + busy audit (top-k 4 cut)"
        results = {"GRPOTrainer (dapo)": [], "PDMGRPOTrainer (pdm_topk, K=20)": [], audited: [], busy: []}
        shares: dict[str, list[float]] = {audited: [], busy: []}
        outside: list[int] = []
        probe_share: list[float] = []
        for _ in range(args.repeats):
            for name in results:
                cut = {"top_k": 4} if name == busy else {}
                cfg = GRPOConfig(output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=8, num_generations=4,
                                 max_completion_length=32, max_steps=args.steps, learning_rate=1e-3, beta=0.0,
                                 temperature=1.0, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                 loss_type="dapo", logging_steps=1, **cut)
                timer = StepTimer()
                kwargs = dict(model=str(tiny), reward_funcs=t._reward, args=cfg, train_dataset=t._dataset(32),
                              callbacks=[timer])
                mask = MaskConfig(rule="pdm_topk", k=20)
                if name == audited:
                    trainer = PDMGRPOTrainer(**kwargs, mask=mask, audit=LiveAuditConfig(every=1, probe_tokens=8))
                elif name == busy:
                    trainer = PDMGRPOTrainer(**kwargs, mask=MaskConfig(rule="pdm_topk", k=20, delta=0.02),
                                             keep_sampling_mask=False,
                                             audit=LiveAuditConfig(every=1, probe_tokens=8, step_scales=(1.0,)))
                else:
                    trainer = PDMGRPOTrainer(**kwargs, mask=mask) if name.startswith("PDM") else GRPOTrainer(**kwargs)
                trainer.train()
                results[name].extend(timer.times[1:])  # first step: warm-up
                if name in shares:
                    logged = [e for e in trainer.state.log_history if "pdm/time/audit_s" in e]
                    shares[name].extend(e["pdm/time/audit_s"] / s for e, s in zip(logged[1:], timer.times[1:]))
                    if name == busy:
                        outside.extend(int(e.get("pdm/audit/outside", 0)) for e in logged[1:])
                        probe_share.extend(e["pdm/time/probe_s"] / e["pdm/time/audit_s"] for e in logged[1:])
        base = statistics.median(results["GRPOTrainer (dapo)"])
        for name, times in results.items():
            med = statistics.median(times)
            print(f"{name:44s} median {med * 1e3:8.1f} ms/step over {len(times)} steps  ratio {med / base:.3f}")
        for name, label in ((audited, "idle audit"), (busy, "busy audit")):
            if shares[name]:
                values = shares[name]
                print(f"{label}'s share of its step: median {statistics.median(values):.3f} "
                      f"(range {min(values):.3f} to {max(values):.3f}, {len(values)} steps)")
        if outside:
            print(f"busy audit: outside tokens per audited step {min(outside)} to {max(outside)}; the probe's "
                  f"share of the audit: median {statistics.median(probe_share):.3f}")


if __name__ == "__main__":
    main()
