"""``pdm-lab bench``: throughput and memory of the core, each against a reference run in the same
process (ratios, not absolute seconds, are what carry across machines).

* mask pipeline (support construction from raw engine output → D → Ḋ → mask → loss → backward)
  for rule ``pdm_topk`` (which, like every rule but DPPO's binary ones, skips the binary KL/TV)
  on N tokens × K, with and without support construction, against one elementwise pass over the
  same [N, K] inputs, alternated round by round (medians; the load average is reported); target:
  within 3× compiled, 5× eager. The reference runs eagerly in both rows (four kernels: exp, sub,
  mul, sum); a compiled one-kernel reference would be faster, so the compiled ratio is lenient.
  Its three [N, K] temporaries are fresh memory each call, and with glibc's default allocator
  their first touch (page faults) can cost more than the arithmetic: the same kernels into
  buffers allocated once give a second ratio, against the compute floor. Measured on 2 cores at
  N = 1M: the plain reference about 3× slower than the floor on the defaults, equal to it with
  ``THP_MEM_ALLOC_ENABLE=1`` (torch's huge-page allocations: 512× fewer faults; the pipeline
  itself ran 1.2–1.3× faster) or ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set
  high. Each row names the allocator settings it ran under.
* train-side gather at Qwen3's vocabulary (151,936), chunked ``policy_on_support`` against the
  naive ``log_softmax(logits / T).gather(...)``; target: ≤ 1/8 of the naive peak memory at equal
  or better speed. Peak memory is measured as the growth of the peak RSS in a fresh subprocess.

Every row source, the core's included, is an entry point of group ``pdm_lab.benchmarks``
(``name = "module:run_bench"``, ``run_bench(args) -> list[dict]``); ``--only`` picks by name.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time

import torch

from pdm_lab.lab.machine import machine_line
from pdm_lab.tools.benchtools import (allocator_setting, alternated_medians, best_of, in_fresh_process, load_average,
                         peak_extra_mb, policy_like, rollout_like_inputs)
from pdm_lab.config import ConfigError, at_least
from pdm_lab.mask_config import MaskConfig
from pdm_lab.loss import pdm_policy_loss
from pdm_lab.cli.plugins import BENCHMARKS, BENCHMARKS_ON_DEMAND, PluginError, discover, load
from pdm_lab.policy_side import policy_on_support, policy_on_support_reference
from pdm_lab.cli.main import integer
from pdm_lab.support import support_from_topk

#: The mask pipeline's vocabulary (Qwen3's), whatever ``--vocab`` the gather bench uses.
PIPELINE_VOCAB = 151_936


def bench_mask_pipeline(n_tokens: int, k: int, repeat: int, modes=(False, True)) -> list[dict]:
    """The core pipeline from raw engine output (support → stats → mask → loss → backward), and the
    same without support construction, against one fused-elementwise reference pass over the
    same [N, K] inputs; all alternated round by round, medians of `repeat` rounds."""
    inp = rollout_like_inputs(n_tokens, k, vocab=PIPELINE_VOCAB)
    cfg = MaskConfig(rule="pdm_topk", k=k)
    adv = inp["advantages"].reshape(-1, 1)
    resp = torch.ones_like(adv, dtype=torch.bool)
    engine = (inp["topk_ids"], inp["topk_logp"], inp["sampled"], inp["sampled_logp"])
    support0 = support_from_topk(*engine, vocab_size=inp["vocab"], k=k)
    pi0 = policy_like(support0, inp["noise"])

    def pipeline(compiled: bool):
        support = support_from_topk(*engine, vocab_size=inp["vocab"], k=k, compiled=compiled)
        pdm_policy_loss(pi0, support, adv, resp, cfg, compiled=compiled).loss.backward()

    def mask_only(compiled: bool):
        pdm_policy_loss(pi0, support0, adv, resp, cfg, compiled=compiled).loss.backward()

    mu, pi = support0.mu_logp[:, :k], pi0.logp.detach()[:, :k]

    def reference():
        # one elementwise pass + reduction over the same [N, K] inputs
        return (torch.exp(mu) * (mu - pi)).sum(dim=1)

    scratch = (torch.empty(mu.shape), torch.empty(mu.shape), torch.empty(mu.shape[0]))

    def reference_floor():
        # the same kernels into buffers allocated once: the [N, K] temporaries of `reference` are
        # fresh memory each call, whose first touch (page faults, with glibc's default of handing
        # large blocks back to the OS) can cost more than the arithmetic
        exp_mu, diff, out = scratch
        torch.exp(mu, out=exp_mu)
        torch.sub(mu, pi, out=diff)
        return torch.sum(exp_mu.mul_(diff), dim=1, out=out)

    fns = {"reference": reference, "reference floor": reference_floor}
    for compiled in modes:
        fns[f"pipeline {compiled}"] = functools.partial(pipeline, compiled)
        fns[f"mask {compiled}"] = functools.partial(mask_only, compiled)
    t = alternated_medians(fns, max(repeat, 1))
    load, allocator = load_average(), allocator_setting()
    rows = []
    for compiled in modes:
        mode = "compiled" if compiled else "eager"
        target = "≤ 3× reference time" if compiled else "≤ 5× reference time"
        for key, name in ((f"pipeline {compiled}", f"mask pipeline [{mode}] N={n_tokens} K={k}: "
                                                   "support+stats+mask+loss+backward"),
                          (f"mask {compiled}", f"  [{mode}] stats+mask+loss+backward (support prebuilt)")):
            rows.append({"name": name, "value": n_tokens / t[key] / 1e6, "unit": "Mtok/s",
                         "reference": n_tokens / t["reference"] / 1e6, "ratio": t[key] / t["reference"],
                         "target": target, "load": load, "allocator": allocator})
    for compiled in modes:
        mode = "compiled" if compiled else "eager"
        for key, what in ((f"pipeline {compiled}", "with support"), (f"mask {compiled}", "support prebuilt")):
            rows.append({"name": f"  [{mode}] {what}, against the reference without fresh memory",
                         "value": n_tokens / t[key] / 1e6, "unit": "Mtok/s",
                         "reference": n_tokens / t["reference floor"] / 1e6,
                         "ratio": t[key] / t["reference floor"], "target": "(the compute floor; no target)",
                         "load": load, "allocator": allocator})
    return rows


def _gather_child(queue, kind: str, n_tokens: int, vocab: int, k: int, backward: bool, repeat: int) -> None:
    torch.manual_seed(0)
    logits = torch.empty(n_tokens, vocab, dtype=torch.bfloat16)
    for lo in range(0, n_tokens, 8):  # row blocks: no float32 [N, V] temporary inflates the baseline
        logits[lo:lo + 8] = torch.randn(min(8, n_tokens - lo), vocab) * 3
    logits.requires_grad_(backward)
    ids = (torch.randint(0, vocab, (n_tokens, 1)) + torch.arange(k + 1)) % vocab  # distinct ids per row
    fn = {"naive": policy_on_support_reference,
          "chunked": functools.partial(policy_on_support, compiled=False),
          "compiled": functools.partial(policy_on_support, compiled=True)}[kind]
    if kind == "compiled":  # compile outside the measured window
        fn(logits[:2], ids[:2], temperature=0.7).logp[:, 0].sum().backward() if backward else \
            fn(logits[:2], ids[:2], temperature=0.7)
        logits.grad = None

    def once():
        out = fn(logits, ids, temperature=0.7)
        if backward:
            out.logp[:, 0].sum().backward()
            logits.grad = None
        return out

    extra_mb = peak_extra_mb(once)
    queue.put({"extra_mb": extra_mb, "seconds": best_of(once, repeat)})


def _measure_gather(kind: str, n_tokens: int, vocab: int, k: int, backward: bool, repeat: int) -> dict:
    return in_fresh_process(_gather_child, kind, n_tokens, vocab, k, backward, repeat)


def bench_gather(n_tokens: int, vocab: int, k: int, repeat: int,
                 kinds=("chunked", "compiled")) -> list[dict]:
    rows = []
    for backward in (False, True):
        naive = _measure_gather("naive", n_tokens, vocab, k, backward, repeat)
        label = "fwd+bwd" if backward else "forward"
        for kind in kinds:
            ours = _measure_gather(kind, n_tokens, vocab, k, backward, repeat)
            rows.append({"name": f"gather [{kind}] {label} N={n_tokens} V={vocab} bf16: peak extra memory",
                         "value": ours["extra_mb"], "unit": "MB", "reference": naive["extra_mb"],
                         "ratio": ours["extra_mb"] / max(naive["extra_mb"], 1e-9),
                         "target": "≤ 1/8 of naive" if not backward else "(grad of logits [N,V] is inherent)"})
            rows.append({"name": f"gather [{kind}] {label}: time", "value": ours["seconds"] * 1e3,
                         "unit": "ms", "reference": naive["seconds"] * 1e3,
                         "ratio": ours["seconds"] / naive["seconds"], "target": "≤ 1 (equal or faster)"})
    return rows


def _import_seconds(code: str, repeat: int) -> float:
    """Median wall time of a fresh interpreter running `code` (start-up included: it cancels in
    the difference of two such medians)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_import(repeat: int) -> list[dict]:
    """What ``import pdm_lab`` and the loss path cost over ``import torch`` (median of `repeat`
    fresh interpreters each)."""
    torch_s = _import_seconds("import torch", repeat)
    rows = []
    for label, code in (("import pdm_lab", "import torch, pdm_lab"),
                        ("the loss path (pdm_policy_loss, MaskConfig, support_from_topk)",
                         "import torch; from pdm_lab import pdm_policy_loss, MaskConfig, support_from_topk")):
        extra = _import_seconds(code, repeat) - torch_s
        rows.append({"name": f"import cost over torch's: {label}", "value": extra, "unit": "s",
                     "reference": torch_s, "ratio": extra / torch_s, "target": "≤ 0.1 s over torch",
                     "load": load_average()})
    return rows


def run_core_bench(args: argparse.Namespace) -> list[dict]:
    modes = (False,) if args.eager_only else (False, True)
    rows = bench_import(args.import_repeat)
    rows += bench_mask_pipeline(args.tokens, args.k, args.repeat, modes)
    kinds = ("chunked",) if args.eager_only else ("chunked", "compiled")
    rows += bench_gather(args.gather_tokens, args.vocab, args.k, args.repeat, kinds)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(machine_line())
    print(f"{'benchmark':<78} {'value':>10} {'unit':>7} {'reference':>10} {'ratio':>7}  target")
    for r in rows:
        load = f"  (load {r['load']:.1f}; allocator: {r.get('allocator', 'default')})" if "load" in r else ""
        print(f"{r['name']:<78.78} {r['value']:>10.4g} {r['unit']:>7} {r['reference']:>10.4g} "
              f"{r['ratio']:>7.3g}  {r['target']}{load}")


def check_sizes(args: argparse.Namespace) -> None:
    """What the option ranges cannot see alone: K + 1 support tokens (top-K and a sampled one)
    must leave a tail in each vocabulary, ``--vocab`` and the pipeline's."""
    for option, vocab in (("--vocab", args.vocab), ("the pipeline's vocabulary", PIPELINE_VOCAB)):
        if args.k + 1 >= vocab:
            raise ConfigError(f"--k {args.k}: must be < {option} − 1 = {vocab - 1} (K + 1 support tokens "
                              "and a tail)")


def main(args: argparse.Namespace) -> int:
    check_sizes(args)
    torch.set_num_threads(args.threads) if args.threads else None
    rows: list[dict] = []
    benches = {**discover(BENCHMARKS), **discover(BENCHMARKS_ON_DEMAND)}
    for name in args.only:
        try:
            run_bench = load(benches[name])
        except PluginError as err:
            print(f"pdm-lab bench: error: {err}", file=sys.stderr)
            return 2
        rows += run_bench(args)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows(rows)
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: ratios against references measured in the same run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=integer(at_least(1)), default=1_000_000,
                   help="tokens for the mask pipeline (default 1M)")
    p.add_argument("--k", type=integer(at_least(1)), default=20, help="top-K (default 20)")
    p.add_argument("--gather-tokens", type=integer(at_least(1)), default=256,
                   help="tokens for the gather bench (default 256)")
    p.add_argument("--vocab", type=integer(at_least(3)), default=PIPELINE_VOCAB,
                   help="vocabulary for the gather bench (Qwen3's)")
    p.add_argument("--repeat", type=integer(at_least(1)), default=3, help="timed repeats, best kept (default 3)")
    p.add_argument("--import-repeat", type=integer(at_least(1)), default=5,
                   help="fresh interpreters per import measurement, median kept (default 5)")
    p.add_argument("--threads", type=integer(at_least(0)), default=0,
                   help="torch threads (default 0: torch's choice)")
    names = list(discover(BENCHMARKS))
    on_demand = list(discover(BENCHMARKS_ON_DEMAND))
    p.add_argument("--only", "--suite", nargs="+", default=names, choices=names + on_demand,
                   help="which benchmarks to run (entry points of pdm_lab.benchmarks; default: all of "
                        "them; those of pdm_lab.benchmarks.on_demand, e.g. the loop against TRL, run "
                        "only when named)")
    p.add_argument("--loop-steps", type=integer(at_least(1)), default=12, help="loop suite: steps per run (default 12)")
    p.add_argument("--loop-rounds", type=integer(at_least(1)), default=2,
                   help="loop suite: alternated rounds (default 2)")
    p.add_argument("--loop-ranks", type=integer(at_least(0)), nargs="+", default=[0],
                   help="loop suite: rank counts of our runs (0: the default from the machine)")
    p.add_argument("--eager-only", action="store_true",
                   help="skip the torch.compile variants (no compile time; a quick smoke run)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=main)
