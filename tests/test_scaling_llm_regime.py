"""The tiny loop in the LLM regime (SPEC §6b): Qwen3's 151,936-id embedding over a locally trained
tokenizer with far fewer tokens, built once, cached by its recipe, loaded back through
``from_pretrained``; the GPU config at a 0.6B-like shape passes ``--dry-run``; and at a small size
the real loop (vLLM CPU engine, one FSDP2 rank) runs an audited step, writes the regime
table and resumes from its checkpoint.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
LLM = REPO / "scaling" / "configs" / "tiny-llm.yaml"
GPU = REPO / "scaling" / "configs" / "tiny-llm-0.6b-gpu.yaml"
SMALL = ["model.tiny.sft_steps=20", "model.tiny.sft_batch_size=8", "model.tiny.tokenizer_vocab_size=600"]


def cli(args: list[str], env: dict | None = None, cwd: Path = REPO, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "pdm_lab", "train", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_gpu_config_dry_run_same_family():
    from scaling.config import load_config

    proc = cli(["--config", str(GPU), "--dry-run"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ok" in proc.stdout
    gpu, cpu = load_config(GPU).model.tiny, load_config(LLM).model.tiny
    assert gpu.vocab_size == cpu.vocab_size == 151936
    assert gpu.tokenizer_vocab_size == cpu.tokenizer_vocab_size  # the same tokenizer recipe
    assert load_config(GPU).data.synthetic == load_config(LLM).data.synthetic
    assert gpu.hidden_size == 1024 and gpu.num_hidden_layers == 28 and gpu.tie_word_embeddings


def test_tokenizer_larger_than_embedding_is_bad_input():
    proc = cli(["--config", str(LLM), "model.tiny.tokenizer_vocab_size=200000", "--dry-run"])
    assert proc.returncode == 2
    assert "tokenizer_vocab_size" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_build_caches_and_round_trips(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scaling.config import load_config
    from scaling.tiny_model import ensure_tiny_model

    monkeypatch.setenv("PDM_LAB_CACHE", str(tmp_path))
    cfg = load_config(LLM, SMALL)
    path = ensure_tiny_model(cfg.model.tiny, cfg.data.synthetic)
    built = path.stat().st_mtime_ns
    assert ensure_tiny_model(cfg.model.tiny, cfg.data.synthetic) == path  # cached by its recipe
    assert path.stat().st_mtime_ns == built
    other = load_config(LLM, [*SMALL, "model.tiny.seed=1"])
    assert ensure_tiny_model(other.model.tiny, other.data.synthetic) != path

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == 151936 and model.config.tie_word_embeddings
    assert len(tok) <= 600 < model.config.vocab_size  # the ids past the tokenizer are never emitted
    prompt = tok.apply_chat_template([{"role": "user", "content": "1234"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].double()
    # save_pretrained → from_pretrained is exact
    again = tmp_path / "again"
    model.save_pretrained(again)
    with torch.no_grad():
        logits2 = AutoModelForCausalLM.from_pretrained(again)(ids).logits[0, -1].double()
    assert torch.equal(logits, logits2)
    # the warm-up moves mass off the never-emitted ids (the tied head pushes their logits down)
    raw = load_config(LLM, [*SMALL, "model.tiny.sft_steps=0"])
    init = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(raw.model.tiny, raw.data.synthetic)).eval()
    with torch.no_grad():
        logits0 = init(ids).logits[0, -1].double()
    tail = float(torch.softmax(logits, -1)[len(tok):].sum())
    assert tail < float(torch.softmax(logits0, -1)[len(tok):].sum())


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.vllm
def test_small_audited_run_resumes(tmp_path):
    pytest.importorskip("vllm")
    env = dict(os.environ, PDM_LAB_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    run_dir = tmp_path / "run"
    common = ["--config", str(LLM), *SMALL, "rollout.prompts_per_step=4", "rollout.group_size=4",
              "rollout.max_tokens=6", "trainer.mini_batches=1", "trainer.micro_batch_size=4",
              "eval.every=0", "checkpoint.every=1", "log.tensorboard=false", "audit.every=1",
              "data.synthetic.n_train=64", "launch.nproc_per_node=1", f"run_dir={run_dir}"]
    first = cli([*common, "total_steps=1"], env=env, cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = cli([*common, "total_steps=2"], env=env, cwd=tmp_path, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(1) == 1 and steps.count(2) == 1  # resumed: step 1 not repeated
    audits = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines()]
    regime = audits[-1]["regime"]
    for key in ("outside_fraction", "tail_ratio", "topk_mass_ge_099", "d_quantiles"):
        assert key in regime, key
    assert 0.0 <= regime["topk_mass_ge_099"] <= 1.0


def test_answer_loss_matches_transformers_loss():
    """The warm-up's answer-only head equals transformers' own masked loss (float64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from scaling.tiny_model import answer_loss

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=32, tie_word_embeddings=True)).double()
    ids = torch.randint(0, 300, (3, 7))
    attn = torch.ones_like(ids)
    attn[0, 5:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 4:] = ids[:, 4:]
    labels[0, 5:] = -100
    ours = model.lm_head.weight.new_tensor(0.0) + answer_loss(model, ids, attn, labels)
    ref = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    torch.testing.assert_close(ours.detach().double(), ref.detach().double(), rtol=1e-6, atol=0)
    labels[1, 6] = 5  # a planted change in one label moves the loss
    assert not torch.isclose(answer_loss(model, ids, attn, labels).detach().double(), ref.detach().double())


def test_offline_regime_of_engine_copies(tmp_path, monkeypatch):
    """The offline table has §6b's fields; an fp32 engine copy has D = 0, an fp8 one does not."""
    from scaling.assets import model_dir
    from scaling.config import load_config
    from scaling.llm_regime import measure

    monkeypatch.setenv("PDM_LAB_CACHE", str(tmp_path))
    cfg = load_config(LLM, SMALL)
    rows = [{"prompt": "reverse 1 2 3 4", "answer": "4321"}, {"prompt": "reverse 5 6 7", "answer": "765"}]
    same = measure(model_dir(cfg), rows, precision="fp32", samples=2, max_tokens=4)
    fp8 = measure(model_dir(cfg), rows, precision="fp8", samples=2, max_tokens=4)
    for rec in (same, fp8):
        for key in ("outside_fraction", "tail_ratio", "topk_mass_ge_099", "d_quantiles", "exact_match"):
            assert key in rec, key
        assert rec["vocab_size"] == 151936 and rec["tokenizer_tokens"] < rec["vocab_size"]
    assert same["d_quantiles"]["max"] == 0.0
    assert fp8["d_quantiles"]["max"] > 0.0
