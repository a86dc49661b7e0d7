"""A tiny random Qwen3 and a locally trained tokenizer, for the CPU run (no hub access).

The model is ``Qwen3ForCausalLM(Qwen3Config(...))`` with head_dim 32 (vLLM's CPU attention has no
head_dim 16 kernel) and an ``lm_head`` tied to the embedding or not (``tie_word_embeddings``;
either way the weight sync must push ``lm_head.weight``: the trap of
``docs/guide/cpu-notes.md``). The tokenizer is a byte-level BPE trained in memory on the
task's text, with digits split one per token, wrapped in ``PreTrainedTokenizerFast`` with a
Qwen-style chat template.

Random weights give flat next-token distributions (top-20 of 512 holds about half the mass), far
from an LLM's. ``sft_steps`` of supervised warm-up on the task (loss on answer tokens only) make
the distributions peaked and give RL a policy that is right sometimes, so the reward has room to
rise. Everything is cached under ``$PDM_LAB_CACHE/tiny/<hash>`` by a hash of the spec.
"""
from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import torch

from .cache import cached_dir
from .tasks import corpus_for_tokenizer, sample_examples

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BUILD_VERSION = 1  # bump when the build recipe changes, to invalidate caches


def build_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE trained on ``corpus``; returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),  # one token per digit: arithmetic stays learnable
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tiny, vocab_size: int, eos_id: int, pad_id: int):
    """``Qwen3ForCausalLM`` from the ``model.tiny`` section, seeded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim, max_position_embeddings=tiny.max_position_embeddings,
        initializer_range=tiny.init_std, tie_word_embeddings=tiny.tie_word_embeddings, eos_token_id=eos_id,
        pad_token_id=pad_id, bos_token_id=None, torch_dtype="float32",
    )
    torch.manual_seed(tiny.seed)
    return Qwen3ForCausalLM(cfg).float()


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def corrupt(answer: str, rng: random.Random) -> str:
    """``answer`` with one character replaced by a different digit (or letter)."""
    if not answer:
        return answer
    i = rng.randrange(len(answer))
    pool = "0123456789" if answer[i].isdigit() else "abcdefghijklmnopqrstuvwxyz"
    return answer[:i] + rng.choice([c for c in pool if c != answer[i]]) + answer[i + 1:]


def sft_warmup(model, tokenizer, examples: list[dict], *, steps: int, lr: float, batch_size: int,
               seed: int, noise: float = 0.0, log_every: int = 50, device: str = "cpu") -> list[float]:
    """Supervised warm-up: cross-entropy on answer tokens (+ end-of-turn) only. Returns losses.

    ``noise``: fraction of examples whose answer is corrupted (fixed per example).
    """
    if steps <= 0:
        return []
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id
    rng = random.Random(seed)
    seqs = []
    for e in examples:
        p = _chat_ids(tokenizer, e["prompt"])
        answer = corrupt(e["answer"], rng) if rng.random() < noise else e["answer"]
        a = tokenizer.encode(answer, add_special_tokens=False) + [eos]
        seqs.append((p, a))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(steps):
        batch = [seqs[rng.randrange(len(seqs))] for _ in range(batch_size)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attn = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            n = len(p) + len(a)
            ids[i, :n] = torch.tensor(p + a)
            labels[i, len(p):n] = torch.tensor(a)
            attn[i, :n] = 1
        ids, labels, attn = ids.to(device), labels.to(device), attn.to(device)
        for g in opt.param_groups:  # cosine decay to 10%
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        loss = answer_loss(model, ids, attn, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"[tiny-model] sft step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.3f}",
                  flush=True)
    model.eval()
    return losses


def answer_loss(model, ids, attn, labels):
    """Mean cross-entropy on the labelled (answer) tokens; same as ``model(..., labels=).loss``,
    but ``lm_head`` runs only at the positions that predict a label: with a 151,936-id embedding
    the logits of the prompt positions would dominate a CPU step."""
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]  # [B, T-1, H]
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(hidden[keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits, target[keep])


def tiny_model_spec(tiny, synthetic) -> dict:
    """Everything that determines the built model (the cache key)."""
    fields = dataclasses.asdict(tiny)
    if fields.get("tokenizer_vocab_size") is None:  # keeps the cache keys of earlier configs
        fields.pop("tokenizer_vocab_size", None)
    return {"version": BUILD_VERSION, "tiny": fields,
            "task": dataclasses.asdict(synthetic)}


def ensure_tiny_model(tiny, synthetic) -> Path:
    """Build (once) and return the directory of the tiny model + tokenizer for a task.

    Args:
        tiny: the ``model.tiny`` config section.
        synthetic: the ``data.synthetic`` section (the tokenizer and warm-up use its task).
    """
    def build(out: Path) -> None:
        corpus = corpus_for_tokenizer(synthetic.name, seed=synthetic.seed + 7,
                                      max_value=synthetic.max_value, length=synthetic.length)
        tokenizer = build_tokenizer(corpus, tiny.tokenizer_vocab_size or tiny.vocab_size)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model = build_model(tiny, tiny.vocab_size, eos, tokenizer.pad_token_id)
        # warm-up examples come from a stream disjoint from the train/eval files' seeds
        examples = sample_examples(synthetic.name, 4096, seed=synthetic.seed + 13,
                                   max_value=synthetic.max_value, length=synthetic.length)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # a 0.6B-like build needs the GPU
        sft_warmup(model.to(device), tokenizer, examples, steps=tiny.sft_steps, lr=tiny.sft_lr,
                   batch_size=tiny.sft_batch_size, seed=tiny.seed, noise=tiny.sft_noise, device=device)
        model = model.cpu()
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return cached_dir("tiny", tiny_model_spec(tiny, synthetic), build)
