"""The regime of a built tiny model and an engine copy of it, offline (SPEC §6b), before any run.

μ is an engine copy of the model (its decoder Linear weights rounded to bf16, or fp8 e4m3 in
128×128 blocks as ``rollout.precision: fp8`` pushes them; embeddings and norms in the engine
dtype; with ``--fp8-activations`` also each decoder Linear's input rounded to e4m3 per token or per
tensor, as ``rollout.fp8_activations`` makes the engine do), π the float32 model. Responses are sampled from μ at temperature 1 on held-out prompts;
at every response position this reports μ's top-K mass, D = top-K KL(μ‖π) on the union support
(the core's ``support_from_full`` / ``topk_kl``) and the calibration table (``regime_table``, every
token counted as Â ≠ 0: no advantages exist offline), the outside fraction at a ladder of smaller δ
(``outside_by_delta``), and the task's exact-match rate. The loop's
own audit measures the same table on live batches with vLLM as μ.

    python -m scaling.llm_regime --config scaling/configs/tiny-llm.yaml --precision bf16
"""
from __future__ import annotations

import argparse
import copy
import json

import torch

from pdm_lab.audit.measure import regime_table
from pdm_lab.divergence import topk_kl
from pdm_lab.numerics import masked_logsumexp
from pdm_lab.lab.quantize import quantize_dequantize

from .fp8 import install_activation_quant, is_quantised_param


DELTA_LADDER = (0.15, 0.1, 0.05, 0.02, 0.01, 5e-3, 1e-3, 5e-4)
"""δ values at which ``measure`` also reports the outside fraction (every token counted)."""


def engine_copy(model, precision: str, activations: str = "none"):
    """μ's weights: fp32, bf16 (every weight), or fp8 (decoder Linears e4m3, the rest bf16); with
    fp8, ``activations`` (``per_token``/``per_tensor``) also rounds each decoder Linear's input."""
    if activations != "none" and precision != "fp8":
        raise ValueError(f"fp8 activations ({activations}) need precision fp8, got {precision}")
    if precision == "fp32":
        return model
    mu = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in mu.named_parameters():
            q = quantize_dequantize(p.data, 128) if precision == "fp8" and is_quantised_param(name, p) else p.data
            p.data.copy_(q.to(torch.bfloat16).float())
    install_activation_quant(mu, activations)
    return mu


def _divergence(mu_logp: torch.Tensor, pi_logp: torch.Tensor, k: int) -> torch.Tensor:
    """[N] top-K KL on μ's top-K (K-slot convention needs no sampled id here)."""
    top = mu_logp.topk(k, dim=-1).indices
    out = torch.ones_like(mu_logp, dtype=torch.bool).scatter_(1, top, False)
    return topk_kl(mu_logp.gather(1, top), pi_logp.gather(1, top),
                   masked_logsumexp(mu_logp, out, dim=1), masked_logsumexp(pi_logp, out, dim=1))


@torch.no_grad()
def measure(path, rows, *, precision: str, activations: str = "none", k: int = 20, delta: float = 0.15,
            samples: int = 4, max_tokens: int = 8, seed: int = 0) -> dict:
    """The regime table of ``precision``'s engine copy against the fp32 model at ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pi = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    mu = engine_copy(pi, precision, activations).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    d, mass, right = [], [], []
    for row in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        ids = torch.tensor([prompt] * samples)
        out = mu.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                          eos_token_id=eos, pad_token_id=tok.pad_token_id)
        resp = out[:, len(prompt):]
        valid = torch.cumsum((resp == eos).long(), 1) - (resp == eos).long() == 0  # up to and with eos
        mu_logp = torch.log_softmax(mu(out).logits[:, len(prompt) - 1:-1].float(), -1)[valid]
        pi_logp = torch.log_softmax(pi(out).logits[:, len(prompt) - 1:-1].float(), -1)[valid]
        d.append(_divergence(mu_logp.double(), pi_logp.double(), k))
        mass.append(mu_logp.double().topk(k, -1).values.exp().sum(-1))
        right += [tok.decode(r[v & (r != eos)]).strip() == row["answer"].strip() for r, v in zip(resp, valid)]
    d, mass = torch.cat(d), torch.cat(mass)
    table = regime_table(d, d > delta, torch.ones_like(d, dtype=torch.bool), topk_mass=mass)
    return {"precision": precision, "fp8_activations": activations, "delta": delta, "k": k,
            "vocab_size": pi.config.vocab_size,
            "tokenizer_tokens": len(tok), "parameters": sum(p.numel() for p in pi.parameters()),
            "exact_match": sum(right) / len(right), "responses": len(right), **table,
            "outside_by_delta": {f"{x:g}": float((d > x).double().mean())
                                 for x in sorted({delta, *DELTA_LADDER}, reverse=True)}}


def main(argv: list[str] | None = None) -> int:
    from .assets import model_dir, synthetic_files
    from .config import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp8"))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--fp8-activations", default=None, choices=("none", "per_token", "per_tensor"),
                   help="fp8 only; default: the config's rollout.fp8_activations when --precision fp8")
    p.add_argument("--delta", type=float, default=None, help="default: the config's mask.delta")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    activations = args.fp8_activations
    if activations is None:
        activations = cfg.rollout.fp8_activations if args.precision == "fp8" else "none"
    if activations != "none" and args.precision != "fp8":
        p.error(f"--fp8-activations {activations} needs --precision fp8")
    _, evals = synthetic_files(cfg)
    rows = [json.loads(x) for x in evals.read_text().splitlines()][:args.prompts]
    rec = measure(model_dir(cfg), rows, precision=args.precision, activations=activations, k=cfg.mask.k,
                  samples=args.samples, delta=cfg.mask.delta if args.delta is None else args.delta, max_tokens=cfg.rollout.max_tokens)
    print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
