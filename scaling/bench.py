"""``pdm-lab bench`` rows of the scaling stage: the real tiny loop's step split and memory.

* time per RL step split into generate / train / sync (median over the steps after the first,
  from a real run of ``tiny-cpu.yaml`` with its default ranks), each as a share of the step time
  measured in the same run;
* the mask's share of the step: the time in ``pdm_policy_loss`` (support statistics, Ḋ, mask,
  surrogate) plus the metrics, against the step; target < 2%;
* memory of the train-side gather at the loop's vocabulary and a step's worth of tokens: the
  loop's path (lm_head on the response rows → ``policy_on_support``, optionally chunked with
  recomputation) against the naive ``log_softmax(lm_head(h) / T).gather(...)``: bytes saved for
  backward (exact, from autograd's saved-tensor hooks) and peak RSS growth in a fresh process.

Optional attributes on ``args`` (the core's parser need not define them): ``scaling_config``
(default tiny-cpu.yaml), ``scaling_steps`` (default 8), ``scaling_tokens`` (default: a step's
response tokens per rank from the run).

``run_loop_bench`` (``pdm-lab bench --suite loop``): the tiny-loop workload run by our loop and, where
TRL is installed, by TRL's ``GRPOTrainer`` (HF generate and vLLM colocate) on the same model,
prompts and batch, alternated; our step's phase split and the step-time ratios to TRL.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pdm_lab.tools.benchtools import in_fresh_process, peak_extra_mb

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny-cpu.yaml"


def _run_loop(config: Path, steps: int, workdir: Path) -> list[dict]:
    run_dir = workdir / "run"
    cmd = [sys.executable, "-m", "pdm_lab.scaling.commands", "train", "--config", str(config),
           f"total_steps={steps}", "eval.every=0", "checkpoint.every=0", "log.sync_check_every=0",
           "log.tensorboard=false", f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(f"bench run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_rows(records: list[dict]) -> list[dict]:
    """Median time split of the steps after the first (engine warm-up)."""
    recs = [r for r in records if r["step"] > 1]
    med = {k: statistics.median(r[k] for r in recs) for k in
           ("time/step_s", "time/generate_s", "time/train_s", "time/sync_s", "time/loss_s", "time/reward_s")}
    step = med["time/step_s"]
    rows = []
    for part in ("generate", "train", "sync", "reward"):
        v = med[f"time/{part}_s"]
        rows.append({"name": f"tiny loop: {part} per step (median of {len(recs)} steps)", "value": v * 1e3,
                     "unit": "ms", "reference": step * 1e3, "ratio": v / step, "target": "share of the step"})
    share = med["time/loss_s"] / step
    rows.append({"name": "tiny loop: mask + loss + metrics per step (pdm_policy_loss)",
                 "value": med["time/loss_s"] * 1e3, "unit": "ms", "reference": step * 1e3,
                 "ratio": share, "target": "< 0.02 of the step"})
    return rows


def _gather_fn(kind: str, hidden: int, vocab: int, k: int, n: int, chunk: int | None):
    from .policy_model import _support_chunk

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.3).requires_grad_()
    # k + 1 distinct ids per row (a support never holds an id twice)
    ids = (torch.randint(0, vocab, (n, 1), generator=gen) + torch.arange(k + 1)) % vocab

    def naive():
        lp = torch.log_softmax((h @ w.t()).float() / 0.7, dim=-1)
        return lp.gather(1, ids)

    def loop():
        if chunk is None:
            return _support_chunk(h, w, ids, 0.7)[0]
        from torch.utils.checkpoint import checkpoint

        parts = [checkpoint(_support_chunk, h[i:i + chunk], w, ids[i:i + chunk], 0.7, use_reentrant=False)[0]
                 for i in range(0, n, chunk)]
        return torch.cat(parts)

    return (naive if kind == "naive" else loop), (h, w)


def saved_bytes(kind: str, hidden: int, vocab: int, k: int, n: int, chunk: int | None) -> int:
    """Bytes autograd keeps for backward (excluding the leaf inputs h and W)."""
    fn, leaves = _gather_fn(kind, hidden, vocab, k, n, chunk)
    leaf_storages = {t.untyped_storage().data_ptr() for t in leaves}
    seen: dict[int, int] = {}

    def pack(t):  # count each storage once; views of the inputs (h chunks) cost nothing extra
        ptr = t.untyped_storage().data_ptr()
        if ptr not in leaf_storages:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out[:, 0].sum().backward()
    return sum(seen.values())


def _rss_child(queue, kind, hidden, vocab, k, n, chunk):
    fn, _ = _gather_fn(kind, hidden, vocab, k, n, chunk)
    queue.put(peak_extra_mb(lambda: fn()[:, 0].sum().backward()))


def peak_rss_mb(kind, hidden, vocab, k, n, chunk) -> float:
    return in_fresh_process(_rss_child, kind, hidden, vocab, k, n, chunk, timeout=600)


def gather_rows(hidden: int, vocab: int, k: int, n: int) -> list[dict]:
    chunk = max(1, n // 8)
    naive_saved = saved_bytes("naive", hidden, vocab, k, n, None)
    rows = []
    for label, c, target in (("loop path", None, "≈ 1 (keeps the [N, V] logits)"),
                             (f"chunked {chunk}", chunk, "≤ 1/4")):
        s = saved_bytes("loop", hidden, vocab, k, n, c)
        rows.append({"name": f"train-side gather N={n} V={vocab} H={hidden}: saved for backward, {label}",
                     "value": s / 2**20, "unit": "MiB", "reference": naive_saved / 2**20,
                     "ratio": s / max(naive_saved, 1), "target": target})
    big = max(n, 65536)
    naive_rss = peak_rss_mb("naive", hidden, vocab, k, big, None)
    for label, c in (("loop path", None), ("chunked", big // 8)):
        r = peak_rss_mb("loop", hidden, vocab, k, big, c)
        rows.append({"name": f"train-side gather N={big} V={vocab}: peak RSS growth fwd+bwd, {label}",
                     "value": r, "unit": "MB", "reference": naive_rss, "ratio": r / max(naive_rss, 1e-9),
                     "target": "≤ 1"})
    return rows


def run_bench(args) -> list[dict]:
    """Rows {"name","value","unit","reference","ratio","target"} for ``pdm-lab bench``."""
    from .config import load_config

    config = Path(getattr(args, "scaling_config", None) or CONFIG)
    steps = int(getattr(args, "scaling_steps", None) or 8)
    cfg = load_config(config)
    with tempfile.TemporaryDirectory(prefix="pdm_scaling_bench_") as tmp:
        records = _run_loop(config, steps, Path(tmp))
    rows = step_rows(records)
    train = [r for r in records if r["step"] > 0]
    tokens = int(getattr(args, "scaling_tokens", None) or
                 statistics.median(r["tokens/response"] for r in train) / max(1, cfg.launch.nproc_per_node or 1))
    tiny = cfg.model.tiny
    hidden, vocab = (tiny.hidden_size, tiny.vocab_size) if tiny else (4096, 151_936)
    rows += gather_rows(hidden, vocab, cfg.mask.k, max(tokens, 1))
    return rows


# ------------------------------------------------------------------ the loop suite (vs TRL)
# The tiny-loop workload: the tiny tied Qwen3 (131k parameters, vocab 512), 8 prompts × 8
# samples × ≤ 8 tokens, fp32, one optimiser step per batch, top-20 log-probs and the mask.
LOOP_WORKLOAD = ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_tokens=8",
                 "trainer.mini_batches=1", "trainer.micro_batch_size=64", "eval.every=0",
                 "checkpoint.every=0", "log.sync_check_every=0", "log.tensorboard=false"]
PHASES = ("generate", "sync", "train", "loss")


def _ours(config: Path, steps: int, ranks: int, workdir: Path) -> dict:
    """One run of ``pdm-lab train``: median step and phase times (ms) over steps 2..N."""
    run_dir = workdir / f"ours_{ranks}"
    cmd = [sys.executable, "-m", "pdm_lab.scaling.commands", "train", "--config", str(config),
           *LOOP_WORKLOAD, f"total_steps={steps}", f"run_dir={run_dir}", "checkpoint.resume=never"]
    if ranks:
        cmd.append(f"launch.nproc_per_node={ranks}")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(f"loop bench run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["step"] > 1]
    out = {"step": statistics.median(r["time/step_s"] for r in recs) * 1e3,
           "step_cpu": statistics.median(r["time/step_cpu_s"] for r in recs) * 1e3}
    for phase in PHASES:
        out[phase] = statistics.median(r[f"time/{phase}_s"] for r in recs) * 1e3
    return out


def _trl_child(model_dir: str, data_file: str, mode: str, steps: int, out: str) -> None:
    """TRL's ``GRPOTrainer`` on the same model, prompts and batch (run in its own process)."""
    import time as _time

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if mode == "vllm":  # TRL's weight sync fails on CPUs where vLLM frees packed weights; our
        from .rollout import keep_cpu_weights_unpacked  # loop computes F.linear on kept weights too
        keep_cpu_weights_unpacked()

    rows = [json.loads(x) for x in Path(data_file).read_text().splitlines()[:512]]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in rows])

    def exact(completions, answer, **_):
        return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer)]

    times: list[float] = []
    cpu: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, self.c0 = _time.perf_counter(), _time.process_time()

        def on_step_end(self, *a, **k):
            times.append(_time.perf_counter() - self.t0)
            cpu.append(_time.process_time() - self.c0)

    args = GRPOConfig(output_dir=str(Path(out).parent / f"trl_{mode}"), per_device_train_batch_size=64,
                      num_generations=8, max_completion_length=8, max_steps=steps, learning_rate=3e-4,
                      beta=0.0, num_iterations=1, steps_per_generation=1, temperature=1.0,
                      logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                      use_vllm=mode == "vllm", vllm_mode="colocate", vllm_enable_sleep_mode=False,
                      vllm_max_model_length=128, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=exact, args=args, train_dataset=data,
                          callbacks=[Timer()])
    trainer.train()
    Path(out).write_text(json.dumps({"step": statistics.median(times[1:]) * 1e3,
                                     "step_cpu": statistics.median(cpu[1:]) * 1e3}))


def _trl(model_dir: Path, data_file: Path, mode: str, steps: int, workdir: Path, threads: int) -> dict:
    out = workdir / f"trl_{mode}.json"
    # the same intra-op threads as our loop: compare the systems, not their thread defaults
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "pdm_lab.scaling.bench", "--trl-child", str(model_dir), str(data_file),
           mode, str(steps), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL {mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_loop_bench(args) -> list[dict]:
    """Rows for ``pdm-lab bench --suite loop``: our step and its phase split, and TRL's step on the
    same model and batch (HF generate and vLLM colocate) where TRL is installed, as ratios.

    Runs alternate (ours, TRL HF, TRL vLLM) for ``loop_rounds`` rounds; medians over rounds of
    per-run medians. The load average is printed with the rows: on a shared machine the
    absolute times move, the ratios less.
    """
    import importlib.util

    from .assets import data_files, model_dir
    from .config import load_config
    from .distributed import threads_per_rank

    config = Path(getattr(args, "scaling_config", None) or CONFIG)
    steps = int(getattr(args, "loop_steps", None) or 12)
    rounds = int(getattr(args, "loop_rounds", None) or 2)
    rank_counts = list(getattr(args, "loop_ranks", None) or [0])
    cfg = load_config(config, LOOP_WORKLOAD)
    path, train_file = model_dir(cfg), data_files(cfg)[0][0]
    threads = threads_per_rank(cfg.launch.threads_per_rank, cfg.model.tiny.hidden_size if cfg.model.tiny
                               else 4096, 1)
    has_trl = importlib.util.find_spec("trl") is not None
    runs: dict[str, list[dict]] = {}
    loads = []
    with tempfile.TemporaryDirectory(prefix="pdm_loop_bench_") as tmp:
        for _ in range(rounds):
            loads.append(os.getloadavg()[0])
            for ranks in rank_counts:
                runs.setdefault(f"ours_{ranks}", []).append(_ours(config, steps, ranks, Path(tmp)))
            if has_trl:
                for mode in ("hf", "vllm"):
                    runs.setdefault(f"trl_{mode}", []).append(_trl(path, train_file, mode, steps, Path(tmp),
                                                                   threads))
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    load = f"load avg {statistics.median(loads):.1f}"
    rows = []
    for ranks in rank_counts:
        ours = med[f"ours_{ranks}"]
        label = f"{ranks} rank{'s' if ranks > 1 else ''}" if ranks else "default ranks"
        for phase in PHASES:
            name = "mask+loss" if phase == "loss" else phase
            rows.append({"name": f"loop [{label}]: {name} per step (median, {rounds} runs × {steps} steps)",
                         "value": ours[phase], "unit": "ms", "reference": ours["step"],
                         "ratio": ours[phase] / ours["step"], "target": f"share of the step; {load}"})
        for mode, target in (("vllm", "≤ 1.0"), ("hf", "as close to 1 as the engine allows")):
            ref = med.get(f"trl_{mode}")
            rows.append({"name": f"loop [{label}]: step vs TRL GRPOTrainer ({'vLLM colocate' if mode == 'vllm' else 'HF generate'}, "
                                 f"{threads} thread{'s' if threads > 1 else ''})",
                         "value": ours["step"], "unit": "ms",
                         "reference": ref["step"] if ref else float("nan"),
                         "ratio": ours["step"] / ref["step"] if ref else float("nan"),
                         "target": f"{target}; {load}" if ref else "TRL not installed ([trl] extra)"})
            if ref and ranks <= 1:  # one process each: CPU seconds per step compare across load
                rows.append({"name": f"loop [{label}]: CPU time per step vs TRL ({'vLLM colocate' if mode == 'vllm' else 'HF generate'})",
                             "value": ours["step_cpu"], "unit": "ms", "reference": ref["step_cpu"],
                             "ratio": ours["step_cpu"] / ref["step_cpu"], "target": f"{target}; {load}"})
    return rows


def main() -> int:
    import argparse

    if len(sys.argv) > 1 and sys.argv[1] == "--trl-child":
        model_dir_, data_file, mode, steps, out = sys.argv[2:7]
        _trl_child(model_dir_, data_file, mode, int(steps), out)
        return 0
    ap = argparse.ArgumentParser(prog="pdm_lab.scaling.bench")
    ap.add_argument("--scaling-config", default=None)
    ap.add_argument("--scaling-steps", type=int, default=8)
    ap.add_argument("--scaling-tokens", type=int, default=None)
    ap.add_argument("--suite", choices=["scaling", "loop"], default="scaling")
    ap.add_argument("--loop-steps", type=int, default=12)
    ap.add_argument("--loop-rounds", type=int, default=2)
    ap.add_argument("--loop-ranks", type=int, nargs="+", default=[0])
    parsed = ap.parse_args()
    rows = run_loop_bench(parsed) if parsed.suite == "loop" else run_bench(parsed)
    for r in rows:
        print(f"{r['name']:<84.84} {r['value']:>10.4g} {r['unit']:>5} {r['reference']:>10.4g} "
              f"{r['ratio']:>7.3g}  {r['target']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
