"""TRL's audit goes through the one live audit (``pdm_lab.audit.live.run_live_audit``) and writes the
probe and the decomposition (SPEC §6d) under the scaling loop's keys, HF-generate mode on the tiny Qwen3.

The expected key sets are not a copy: they are what the core's own record functions return
(``own_update_probe``/``pool_probe``, ``step_decomposition``/``pool_decomposition``,
``step_scale_record``) for a view shaped like the loop's (K, J P Jᵀ under AdamW, the output
layer's part and W; μ's top-K only, so no full KL).
"""
from __future__ import annotations

import json

import pytest
import torch

from pdm_lab import MaskConfig
from pdm_lab.audit.live import LiveAuditConfig

from test_trl_trainer import K, _dataset, _reward, build_tiny

RULES = ("dppo_topk_kl", "pdm_topk", "none")
SCALES = (1.0, 0.1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3-audit-probe"))


def _core_keys(rules, precondition: bool) -> tuple[set, set, set]:
    """(probe keys, decomposition keys, step-scale keys) as the core's functions write them
    (``precondition``: the optimiser has a P, i.e. AdamW after its first step)."""
    from pdm_lab.audit.probe import (own_direction, own_update_probe, pool_decomposition, pool_probe, step_decomposition,
                               support_in_float64)
    from pdm_lab.audit.probe_record import step_scale_record
    from pdm_lab.support import support_from_topk

    gen = torch.Generator().manual_seed(0)
    m, vocab, d = 6, 12, 3
    logits = torch.randn(m, vocab, generator=gen, dtype=torch.float64)
    mu = torch.log_softmax(logits + 0.5 * torch.randn(m, vocab, generator=gen, dtype=torch.float64), -1)
    top = mu.topk(K // 2, dim=-1)
    sampled = top.indices[:, 0]
    support = support_in_float64(support_from_topk(top.indices, top.values.float(), sampled, top.values[:, 0].float(),
                                                   vocab_size=vocab, k=K // 2))
    v = own_direction(logits, sampled)
    kv = {"K": 2.0 * v, "head": v, **({"JPJ": 3.0 * v} if precondition else {})}
    adv = torch.tensor([1.0, -1.0] * (m // 2), dtype=torch.float64)
    dis = torch.tensor([True, False] * (m // 2))
    probe = pool_probe([own_update_probe(support, logits, kv, adv, torch.ones(m, dtype=torch.float64), rules=rules,
                                         disagreement=dis, unembedding=torch.randn(vocab, d, generator=gen,
                                                                                   dtype=torch.float64))])
    x = torch.rand(m, generator=gen, dtype=torch.float64)
    decomp = pool_decomposition([step_decomposition(x, x, x / 2, x / 4, x / 8)])
    keep = {r: torch.tensor([True, False] * (m // 2)) for r in rules}
    scale = step_scale_record(rules, keep, {r: x for r in rules}, x, x + 1, dis, 1e-9, 1.0)
    return set(probe), set(decomp), set(scale)


def test_trl_audit_writes_the_loops_probe_and_decomposition_keys(tiny_dir, tmp_path, monkeypatch):
    from trl import GRPOConfig

    from pdm_lab.integrations import trl_audit_stage
    from pdm_lab.integrations.trl import PDMGRPOTrainer
    from pdm_lab.policy_side import policy_on_support
    from pdm_lab.tokenwise import token_stats

    # the probe's own view of the probed rows (hidden state · W in float64) gives the same D as the
    # audit's measurement through the model's logits: rows, positions and support line up
    views = []
    original = trl_audit_stage.TRLAuditStage.probe_view

    def spy(self, rows, preconditioner):
        view = original(self, rows, preconditioner)
        measured = self.measure()[rows.to(self.advantages.device)].cpu()
        pi = policy_on_support(view.logits, view.support.ids, temperature=1.0)  # logits already / T
        views.append((rows.numel(), measured, token_stats(view.support, pi, binary=False).topk_kl))
        return view

    monkeypatch.setattr(trl_audit_stage.TRLAuditStage, "probe_view", spy)
    audit = LiveAuditConfig(every=1, rules=RULES, delta=0.01, probe_tokens=6, step_scales=SCALES)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=10, max_steps=2, learning_rate=5e-2, beta=0.0, temperature=1.0, top_k=4,
                      top_p=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", bf16=False)
    trainer = PDMGRPOTrainer(model=str(tiny_dir), reward_funcs=_reward, args=args, train_dataset=_dataset(),
                             mask=MaskConfig(rule="pdm_topk", delta=0.01, k=K), audit=audit, keep_sampling_mask=False)
    trainer.train()

    records = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # step 1 audits a fresh AdamW (no P yet); step 2 one with state, as most of the loop's steps
        probe_keys, decomp_keys, scale_keys = _core_keys(RULES, precondition=record["step"] > 1)
        assert {"probe", "decomposition", "step_scales", "time/probe_s", "pairs", "regime"} <= set(record)
        assert record["outside"] > 0 and record["probe"] is not None
        assert 1 <= record["probe"]["probe/tokens"] <= 6
        assert set(record["probe"]) == probe_keys
        assert set(record["decomposition"]) == set(RULES)
        kept = [r for r in RULES if record["decomposition"][r] is not None]
        assert "none" in kept  # "none" keeps every probed token
        for rule in kept:
            assert set(record["decomposition"][rule]) == decomp_keys
            assert record["decomposition"][rule]["decomp/tokens"] >= 1
        shares = record["decomposition"]["none"]
        assert sum(shares[f"decomp/share/{p}"]["mean"] for p in ("own", "rest", "memory", "remainder")) == \
            pytest.approx(1.0)
        assert set(record["step_scales"]) == {"1", "0.1"}
        for entry in record["step_scales"].values():
            assert set(entry) == scale_keys
        assert record["probe"]["probe/data"]["head_share"] is not None  # the output layer's part was supplied
    assert "probe/agree_precond/pdm_topk/outside/topk_kl" in records[1]["probe"]  # AdamW's P after a real step

    assert [v[0] for v in views] == [r["probe"]["probe/tokens"] for r in records]
    for _n, measured, from_view in views:
        torch.testing.assert_close(from_view, measured, rtol=1e-4, atol=1e-7)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"pdm/time/probe_s", "pdm/time/audit_s", "pdm/audit/outside"} <= logged
