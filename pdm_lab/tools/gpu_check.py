"""``make gpu-check``: the core's speed and memory on one accelerator, as one JSON.

Runs from the repository root without installing anything (``PYTHONPATH=. python3 -m
pdm_lab.tools.gpu_check``) on a device image with torch and transformers only (no vLLM, nothing
downloaded: the model is a random init from a config). Three sections, written as each finishes:

* ``copy``: measured device copy bandwidth (bytes read + written / time), the limit the next
  section is held against.
* ``pipeline``: support construction from engine output → stats → mask → loss → backward at
  N = 1M … 16M, K = 20, eager and compiled; time against the HBM limit: the bytes the pipeline
  must move (read the engine's [N, K] block and π on the support, write the support and the
  gradient) divided by the copy bandwidth.
* ``gather``: ``policy_on_support`` (chunked) against the naive ``log_softmax(...).gather`` at
  V = 151,936, N = 32k, bf16 logits, forward + backward: peak memory and time.
* ``model``: a Qwen3-4B-architecture model (random init, bf16) forward + backward over 8k tokens
  with the PDM loss through the chunked gather against naive logits: peak memory, step time and
  the mask's share of the step.

``--tiny`` runs the same code at toy sizes on the CPU (a test does, so the script cannot rot).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdm_lab.tools.benchtools import alternated_medians, load_average, peak_extra_mb, policy_like, rollout_like_inputs
from pdm_lab.mask_config import MaskConfig
from pdm_lab.loss import pdm_policy_loss
from pdm_lab.policy_side import policy_on_support, policy_on_support_reference
from pdm_lab.support import support_from_topk


@dataclass(frozen=True)
class Sizes:
    """What each section runs at."""

    copy_mb: int = 2048
    pipeline_tokens: tuple[int, ...] = (1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24)
    k: int = 20
    vocab: int = 151_936
    gather_tokens: int = 32_768
    model_tokens: int = 8192
    model_sequences: int = 4
    hidden: int = 2560  # Qwen3-4B
    layers: int = 36
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 9728
    rounds: int = 5
    compile: bool = True


TINY = Sizes(copy_mb=16, pipeline_tokens=(2048, 4096), vocab=1000, gather_tokens=64, model_tokens=128,
             model_sequences=2, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
             rounds=2, compile=False)


class Device:
    """Timing and peak memory on CUDA (events, allocator counters) or CPU (clock, peak RSS)."""

    def __init__(self, name: str):
        self.name = name
        self.cuda = name.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def peak_extra_mb(self, fn) -> float:
        """MB by which peak memory grows while `fn` runs (inputs already allocated)."""
        if not self.cuda:
            return peak_extra_mb(fn)
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        self.sync()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def copy_bandwidth(dev: Device, sizes: Sizes) -> dict:
    n = sizes.copy_mb * 2**20 // 4
    src = torch.randn(n, device=dev.name)
    dst = torch.empty_like(src)
    t = alternated_medians({"copy": lambda: dst.copy_(src)}, sizes.rounds, dev.sync)["copy"]
    return {"bytes": 2 * src.numel() * 4, "seconds": t, "GB_per_s": 2 * src.numel() * 4 / t / 1e9}


def pipeline_bytes(n: int, k: int) -> int:
    """Bytes the pipeline must move at least: read the engine's ids (int64) and log-probs, k, log μ_k,
    Â and π on the support; write the support (int32 ids, log μ) and the gradient of log π."""
    m = k + 1
    read = n * k * (8 + 4) + n * (8 + 4 + 4) + n * m * 4
    write = n * m * (4 + 4) + n * m * 4
    return read + write


def pipeline_section(dev: Device, sizes: Sizes, bandwidth: float) -> list[dict]:
    rows = []
    modes = (False, True) if sizes.compile else (False,)
    for n in sizes.pipeline_tokens:
        inp = rollout_like_inputs(n, sizes.k, sizes.vocab, device=dev.name)
        engine = (inp["topk_ids"], inp["topk_logp"], inp["sampled"], inp["sampled_logp"])
        adv = inp["advantages"].reshape(-1, 1)
        resp = torch.ones_like(adv, dtype=torch.bool)
        cfg = MaskConfig(rule="pdm_topk", k=sizes.k)
        pi = policy_like(support_from_topk(*engine, vocab_size=sizes.vocab, k=sizes.k), inp["noise"])

        def step(compiled: bool):
            support = support_from_topk(*engine, vocab_size=sizes.vocab, k=sizes.k, compiled=compiled)
            pdm_policy_loss(pi, support, adv, resp, cfg, compiled=compiled).loss.backward()

        t = alternated_medians({c: (lambda c=c: step(c)) for c in modes}, sizes.rounds, dev.sync)
        limit = pipeline_bytes(n, sizes.k) / bandwidth
        for compiled in modes:
            rows.append({"tokens": n, "k": sizes.k, "mode": "compiled" if compiled else "eager",
                         "seconds": t[compiled], "Mtok_per_s": n / t[compiled] / 1e6,
                         "bytes_moved": pipeline_bytes(n, sizes.k), "hbm_limit_seconds": limit,
                         "ratio_to_limit": t[compiled] / limit})
        del inp, engine, pi
        dev.free()
    return rows


def gather_section(dev: Device, sizes: Sizes) -> dict:
    n, vocab = sizes.gather_tokens, sizes.vocab
    gen = torch.Generator(device=dev.name).manual_seed(0)
    logits = (torch.randn(n, vocab, device=dev.name, dtype=torch.bfloat16, generator=gen) * 3).requires_grad_()
    ids = (torch.randint(0, vocab, (n, 1), device=dev.name, generator=gen)  # distinct ids per row
           + torch.arange(sizes.k + 1, device=dev.name)) % vocab
    out = {}
    for name, fn in (("naive", policy_on_support_reference), ("chunked", policy_on_support)):
        def once(fn=fn):
            fn(logits, ids, temperature=0.7).logp[:, 0].sum().backward()
            logits.grad = None
        peak = dev.peak_extra_mb(once)
        t = alternated_medians({name: once}, sizes.rounds, dev.sync)[name]
        out[name] = {"peak_extra_mb": peak, "seconds": t}
        dev.free()
    out["memory_ratio"] = out["chunked"]["peak_extra_mb"] / max(out["naive"]["peak_extra_mb"], 1e-9)
    out["time_ratio"] = out["chunked"]["seconds"] / out["naive"]["seconds"]
    out.update(tokens=n, vocab=vocab, dtype="bfloat16", what="forward + backward, grad of logits included")
    return out


def _model(dev: Device, sizes: Sizes):
    from transformers import Qwen3Config, Qwen3ForCausalLM  # only this section needs transformers
    cfg = Qwen3Config(vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
                      num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
                      head_dim=sizes.head_dim, intermediate_size=sizes.intermediate,
                      max_position_embeddings=max(4096, sizes.model_tokens), tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(dev.name):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return model, cfg


def model_section(dev: Device, sizes: Sizes) -> dict:
    model, cfg = _model(dev, sizes)
    b = sizes.model_sequences
    t_len = sizes.model_tokens // b
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, sizes.vocab, (b, t_len), generator=gen).to(dev.name)
    n = b * t_len
    inp = rollout_like_inputs(n, sizes.k, sizes.vocab, seed=2, device=dev.name)
    engine = (inp["topk_ids"], inp["topk_logp"], inp["sampled"], inp["sampled_logp"])
    adv = inp["advantages"].reshape(b, t_len)
    resp = torch.ones_like(adv, dtype=torch.bool)
    mask_cfg = MaskConfig(rule="pdm_topk", k=sizes.k)
    timings: dict[str, float] = {}

    def step(gather) -> None:
        start = time.perf_counter()
        dev.sync()
        support = support_from_topk(*engine, vocab_size=sizes.vocab, k=sizes.k)
        dev.sync()
        t_support = time.perf_counter() - start
        logits = model(input_ids=input_ids).logits.reshape(n, -1)
        pi = gather(logits, support.ids, temperature=1.0)
        dev.sync()
        start = time.perf_counter()
        out = pdm_policy_loss(pi, support, adv, resp, mask_cfg)
        dev.sync()
        timings["mask"] = t_support + time.perf_counter() - start
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    result = {"params": sum(p.numel() for p in model.parameters()), "tokens": n, "sequences": b,
              "dtype": "bfloat16", "config": {k: getattr(cfg, k) for k in (
                  "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size")}}
    for name, gather in (("chunked", policy_on_support), ("naive", policy_on_support_reference)):
        peak = dev.peak_extra_mb(lambda: step(gather))
        t = alternated_medians({name: lambda: step(gather)}, max(2, sizes.rounds // 2), dev.sync)[name]
        result[name] = {"peak_extra_mb": peak, "step_seconds": t,
                        "mask_seconds": timings["mask"], "mask_share": timings["mask"] / t}
        dev.free()
    result["memory_ratio"] = result["chunked"]["peak_extra_mb"] / max(result["naive"]["peak_extra_mb"], 1e-9)
    return result


def run(out: Path, sizes: Sizes, device: str) -> dict:
    dev = Device(device)
    report = {"device": torch.cuda.get_device_name() if dev.cuda else platform.processor() or "cpu",
              "torch": torch.__version__, "sizes": asdict(sizes), "load_average": load_average()}
    out.parent.mkdir(parents=True, exist_ok=True)

    def section(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as err:  # one section failing must not lose the others' figures
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        report[name + "_wall_seconds"] = time.perf_counter() - start
        out.write_text(json.dumps(report, indent=2))
        print(f"gpu-check: {name} done in {report[name + '_wall_seconds']:.1f} s", flush=True)

    section("copy", lambda: copy_bandwidth(dev, sizes))
    bandwidth = report["copy"].get("GB_per_s", 0.0) * 1e9 or float("nan")
    section("pipeline", lambda: pipeline_section(dev, sizes, bandwidth))
    section("gather", lambda: gather_section(dev, sizes))
    section("model", lambda: model_section(dev, sizes))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/gpu_check.json"))
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (what CI runs)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = TINY if args.tiny else Sizes()
    if args.tiny:
        torch.set_num_threads(1)  # toy sizes: thread hand-offs would cost more than the work
    report = run(args.out, sizes, device)
    errors = [name for name, v in report.items() if isinstance(v, dict) and "error" in v]
    print(f"gpu-check: wrote {args.out}" + (f"; failed sections: {', '.join(errors)}" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
