"""TRL step time with and without the PDM subclass on the tiny Qwen3, same process, same settings.

    .venv-trl/bin/python tests_frameworks/trl/bench_trl_step.py [--steps N] [--repeats R]

Prints the median seconds per optimizer step of plain ``GRPOTrainer`` (loss_type dapo) and of
``PDMGRPOTrainer`` (rule pdm_topk, K = 20), interleaved runs, and their ratio. Not a test: a
measurement (no timed assertion anywhere)."""
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
    from pdm_lab import MaskConfig
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
        results = {"GRPOTrainer (dapo)": [], "PDMGRPOTrainer (pdm_topk, K=20)": []}
        for _ in range(args.repeats):
            for name in results:
                cfg = GRPOConfig(output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=8, num_generations=4,
                                 max_completion_length=32, max_steps=args.steps, learning_rate=1e-3, beta=0.0,
                                 temperature=1.0, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                 loss_type="dapo", logging_steps=1)
                timer = StepTimer()
                kwargs = dict(model=str(tiny), reward_funcs=t._reward, args=cfg, train_dataset=t._dataset(32),
                              callbacks=[timer])
                trainer = (PDMGRPOTrainer(**kwargs, mask=MaskConfig(rule="pdm_topk", k=20)) if name.startswith("PDM")
                           else GRPOTrainer(**kwargs))
                trainer.train()
                results[name].extend(timer.times[1:])  # first step: warm-up
        base = statistics.median(results["GRPOTrainer (dapo)"])
        for name, times in results.items():
            med = statistics.median(times)
            print(f"{name:34s} median {med * 1e3:8.1f} ms/step over {len(times)} steps  ratio {med / base:.3f}")


if __name__ == "__main__":
    main()
