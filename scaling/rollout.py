"""The behaviour policy μ: a vLLM offline engine inside each rank, and its output as tensors.

Layout (``docs/guide/cpu-notes.md``): every torchrun rank builds its own in-process engine
with ``distributed_executor_backend="external_launcher"``; ranks are split into data-parallel
groups of ``rollout.tensor_parallel_size``. A data-parallel group rolls out its own prompts; the
ranks of one tensor-parallel group run the same requests in lock-step and get identical outputs.
(An in-process engine on rank 0 only hangs: vLLM joins the existing process group collectively.)

μ is what the engine sampled from: ``logprobs_mode="processed_logprobs"`` (log_softmax of the
temperature-scaled, top-k/top-p-filtered logits; −inf where cut) with ``flat_logprobs`` so that
each position's K+1 entries (the sampled token first, then the top-K) reshape straight into
tensors without building a Python dict per token (``pdm_lab.engine_topk``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Sequence

import torch
from torch import Tensor

from pdm_lab.engine_topk import pad_responses, topk_from_flat


def set_engine_env() -> None:
    """Environment vLLM must see before import: in-process engine core (fast start, tensors
    through ``collective_rpc``, deterministic external-launcher execution)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def engine_dtype(precision: str) -> str:
    """vLLM compute dtype for a rollout precision (fp8 rolls out bf16 activations over fp8 weights)."""
    return {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}[precision]


def updates_in_place(rollout_cfg) -> bool:
    """Whether the engine keeps unpacked weights that the sync overwrites in place (CPU only)."""
    native_fp8 = rollout_cfg.precision == "fp8" and rollout_cfg.fp8_mode == "native"
    return rollout_cfg.inplace_sync and not torch.cuda.is_available() and not native_fp8


def keep_cpu_weights_unpacked() -> None:
    """Make vLLM's CPU linear layers (and the output layer) compute ``F.linear`` from their own
    weight tensor instead of a oneDNN handle packed from a copy of it. Call it before the engine
    is built; idempotent.

    vLLM packs each linear's weight into an opaque oneDNN handle after loading and frees the
    weight; a packed handle cannot be updated, so every ``reload_weights`` rebuilds all of them
    (on a tiny model most of the sync). With the weights kept, the sync writes them in place
    (``weight_sync.push_weights``). Layers that are not 2-D matrices keep vLLM's own dispatch.

    It also keeps TRL's colocate mode working on CPU: where vLLM 0.32's oneDNN path is available
    (seen on an AVX-512 AMD EPYC; not on every CPU), the freed weight is an empty ``Parameter``
    without a ``weight_loader``, and TRL's weight sync (``load_weights``) fails with
    AttributeError on its first step.
    """
    from vllm.model_executor.layers import utils

    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__wrapped__", utils.dispatch_cpu_unquantized_gemm)

    def dispatch(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.__wrapped__ = original
    utils.dispatch_cpu_unquantized_gemm = dispatch


def make_engine(model_dir: str, rollout_cfg, *, k: int, max_model_len: int, seed: int,
                data_parallel_size: int, distributed: bool):
    """Build the in-process vLLM engine of this rank.

    Args:
        model_dir: local Hugging Face directory (weights are replaced by the first sync anyway).
        rollout_cfg: the ``rollout`` config section.
        k: log-probs per position (``mask.k``).
        max_model_len: prompt + response context.
        seed: engine seed (sampling uses per-request seeds on top).
        data_parallel_size: world_size / tensor_parallel_size.
        distributed: True under torchrun (external launcher); False for a single process.

    With ``rollout.fp8_activations`` the engine's decoder Linears also round their inputs to
    e4m3 (``scaling.fp8.install_engine_activation_quant``), on top of the fp8 weights the sync
    pushes.
    """
    set_engine_env()
    from vllm import LLM

    if updates_in_place(rollout_cfg):
        keep_cpu_weights_unpacked()

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        model=model_dir, tokenizer=model_dir, dtype=engine_dtype(rollout_cfg.precision),
        enforce_eager=rollout_cfg.enforce_eager, logprobs_mode="processed_logprobs",
        max_logprobs=max(k, 20), seed=seed, max_model_len=max_model_len,
        enable_prefix_caching=rollout_cfg.enable_prefix_caching,
        max_num_seqs=rollout_cfg.max_num_seqs, tensor_parallel_size=rollout_cfg.tensor_parallel_size,
    )
    if distributed:
        kwargs.update(distributed_executor_backend="external_launcher")
        if data_parallel_size > 1:
            kwargs.update(data_parallel_size=data_parallel_size)
    if on_gpu:
        kwargs.update(gpu_memory_utilization=rollout_cfg.gpu_memory_utilization)
    else:
        # the CPU backend reserves 90% of RAM by default and refuses to start: size it explicitly
        kwargs.update(kv_cache_memory_bytes=int(rollout_cfg.kv_cache_gib * (1 << 30)))
    if rollout_cfg.precision == "fp8" and rollout_cfg.fp8_mode == "native":
        kwargs.update(quantization="fp8")
    llm = LLM(**kwargs)
    # every in-place reload warns that the rotary embedding (no weights) got none: expected
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    if getattr(rollout_cfg, "fp8_activations", "none") != "none":
        # W8A8: e4m3 round trip of every quantised Linear's input, in the engine's own modules
        from .fp8 import install_engine_activation_quant

        install_engine_activation_quant(llm, rollout_cfg.fp8_activations)
    return llm


def request_seed(*parts: int | str) -> int:
    """A 31-bit seed from a tuple (run seed, purpose, step, prompt index, ...): stable across runs,
    so a resumed run samples exactly what the uninterrupted one did."""
    blob = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little") & 0x7FFF_FFFF


@dataclasses.dataclass
class RolloutBatch:
    """One rank's rollouts: B = prompts × G sequences, T = longest response.

    Attributes:
        prompt_ids: B lists of prompt token ids.
        response_ids: [B, T] int64 sampled tokens (0 at padding).
        response_mask: [B, T] bool, True on response tokens (incl. the end-of-turn token).
        sampled_logp: [B, T] float32 log μ_k (0 at padding).
        topk_ids: [B, T, K] int64 μ's top-K ids (−1 at padding).
        topk_logp: [B, T, K] float32 their processed log-probs (−inf at padding / cut tokens).
        group: [B] int64 prompt index within this rank's batch (GRPO groups).
        truncated: [B] bool, stopped by the length budget.
        texts: B decoded responses (for the verifier).
        answers: B reference answers.
    """

    prompt_ids: list[list[int]]
    response_ids: Tensor
    response_mask: Tensor
    sampled_logp: Tensor
    topk_ids: Tensor
    topk_logp: Tensor
    group: Tensor
    truncated: Tensor
    texts: list[str]
    answers: list[str]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: Sequence[int]) -> "RolloutBatch":
        """Rows ``idx`` (keeps T)."""
        ix = torch.as_tensor(list(idx), dtype=torch.long)
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[i] for i in idx], response_ids=self.response_ids[ix],
            response_mask=self.response_mask[ix], sampled_logp=self.sampled_logp[ix],
            topk_ids=self.topk_ids[ix], topk_logp=self.topk_logp[ix], group=self.group[ix],
            truncated=self.truncated[ix], texts=[self.texts[i] for i in idx],
            answers=[self.answers[i] for i in idx])


def outputs_to_batch(outputs, prompt_ids: list[list[int]], answers: list[str], *, k: int,
                     tokenizer) -> RolloutBatch:
    """Turn ``LLM.generate`` outputs (one RequestOutput per prompt, n completions each) into a
    RolloutBatch, sequence order: prompt-major, then sample. μ's top-K of each completion is read
    by the core's parser (``pdm_lab.engine_topk.topk_from_flat``) and padded as it pads."""
    rows = []
    for p, (out, pids, ans) in enumerate(zip(outputs, prompt_ids, answers)):
        for comp in out.outputs:
            toks = list(comp.token_ids)
            top = topk_from_flat(comp.logprobs, toks, k, response=len(rows))
            rows.append((p, pids, ans, toks, top, comp.finish_reason == "length"))
    width = max([len(r[3]) for r in rows] + [1])
    batch = pad_responses([r[4] for r in rows], width)
    lengths = torch.tensor([len(r[3]) for r in rows], dtype=torch.long)
    texts = tokenizer.batch_decode([r[3] for r in rows], skip_special_tokens=True)
    return RolloutBatch(
        prompt_ids=[list(r[1]) for r in rows], response_ids=batch.sampled,
        response_mask=torch.arange(width)[None, :] < lengths[:, None],
        sampled_logp=batch.sampled_logp, topk_ids=batch.ids, topk_logp=batch.logp,
        group=torch.tensor([r[0] for r in rows], dtype=torch.long),
        truncated=torch.tensor([r[5] for r in rows], dtype=torch.bool),
        texts=texts, answers=[r[2] for r in rows])


def sampling_params(*, n: int, temperature: float, top_p: float, top_k: int, max_tokens: int,
                    logprobs: int | None, seed: int, stop_token_ids: list[int], min_p: float = 0.0):
    """SamplingParams for rollouts: token ids only (no detokenisation), flat log-probs. The
    top-k/top-p/min-p cut is what ``rollout.keep_sampling_mask`` reproduces on the trainer
    (``pdm_lab.sampling_mask``, vLLM's order and comparisons)."""
    from vllm import SamplingParams

    return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          max_tokens=max_tokens, logprobs=logprobs, seed=seed, detokenize=False,
                          flat_logprobs=True, stop_token_ids=stop_token_ids,
                          skip_special_tokens=True)


def generate(llm, prompt_ids: list[list[int]], params: list) -> list:
    """``llm.generate`` on token-id prompts, one SamplingParams per prompt (per-prompt seeds)."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
    return llm.generate(prompts, params, use_tqdm=False)


def score_sequence(llm, token_ids: list[int]) -> Tensor:
    """vLLM's log-probs of a fixed sequence's tokens 1..L−1 (prompt log-probs: raw, T = 1). [L−1]"""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                       use_tqdm=False)[0]
    vals = []
    for tok, entry in zip(token_ids[1:], out.prompt_logprobs[1:]):
        vals.append(entry[tok].logprob)
    return torch.tensor(vals, dtype=torch.float64)


def shutdown_engine(llm) -> None:
    """Shut the engine down before the process group goes away (its finaliser would otherwise
    try to destroy groups that no longer exist)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
