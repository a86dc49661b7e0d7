"""The loop's model family inside the token MDP (``policy=qwen3``): a ``transformers`` Qwen3 read over the
transformer toy's context window, with the engine's hooks and the toy audit's probe keys. (Its float64 K v
against actual steps: ``test_envs_faithful_toy``.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pdm_lab.envs.audit.own_update import head_names  # noqa: E402
from pdm_lab.envs.policies.models import make_policy  # noqa: E402
from pdm_lab.envs.policies.qwen3 import Qwen3Policy  # noqa: E402
from pdm_lab.envs.policies.transformer import WINDOW  # noqa: E402
from pdm_lab.envs.problems.mismatch import Mismatch  # noqa: E402
from pdm_lab.envs.problems.problem import ProblemConfig, TokenMDPConfig, make_problem  # noqa: E402
from pdm_lab.envs.problems.rollout import RolloutRNG  # noqa: E402

TINY = ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=32, max_len=14))
PAD = 32


def policy_and_obs(kind="qwen3", rows=24, seed=0):
    problem = make_problem(TINY)
    policy = make_policy(kind, problem.encoder, problem.prior, hidden=16, seed=seed).double()
    batch = problem.collect(policy, Mismatch(), 2, 8, RolloutRNG(0))
    obs = batch.obs.reshape(-1, batch.obs.shape[-1])
    order = torch.argsort((obs[:, 1:] != PAD).sum(1), descending=True)  # some contexts exceed the window
    return policy, obs[order[:rows]]


def test_the_window_alone_decides_the_trainable_logits():
    policy, obs = policy_and_obs()
    long = obs[(obs[:, 1:] != PAD).sum(1) > WINDOW][:1]
    assert long.numel()
    edited = long.clone()
    edited[0, 1] = (edited[0, 1] + 1) % PAD  # a token before the window
    last = int((long[0, 1:] != PAD).sum())
    with torch.no_grad():
        assert torch.equal(policy.trainable_logits(long), policy.trainable_logits(edited))
        edited[0, last] = (long[0, last] + 1) % PAD  # the last written token
        assert not torch.equal(policy.trainable_logits(long), policy.trainable_logits(edited))


def test_a_short_context_reads_no_pad():
    """Left padding is invisible: a context's hidden state does not depend on the pad row's embedding."""
    policy, obs = policy_and_obs()
    short = obs[(obs[:, 1:] != PAD).sum(1) < WINDOW][:4]
    assert short.numel()
    with torch.no_grad():
        before = policy.hidden_state(short)
        policy.model.embed_tokens.weight[PAD].add_(3.0)
        assert torch.allclose(policy.hidden_state(short), before, rtol=0, atol=1e-12)


def test_the_tied_unembedding_is_the_token_embedding_and_the_untied_has_its_own():
    tied, _ = policy_and_obs("qwen3")
    untied, _ = policy_and_obs("qwen3_untied")
    assert tied.unembedding().data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert tied.w2.shape == (16, PAD) and head_names(tied) == ()
    assert untied.unembedding() is untied.head and untied.head.shape == (PAD, 16)


def test_the_seed_decides_the_weights_and_leaves_the_global_generator_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a, _ = policy_and_obs(seed=1)
    assert torch.equal(torch.rand(3), expected)
    b, _ = policy_and_obs(seed=1)
    c, _ = policy_and_obs(seed=2)
    assert torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)


def test_the_fp8_engine_rounds_the_projections_in_its_copy_and_never_the_trainer():
    """(Each engine kind's copy is a deterministic function of the context: ``test_envs_faithful_toy``.)"""
    policy, obs = policy_and_obs(rows=12)
    policy = policy.float()
    engine = Mismatch.parse("fp8_engine:0").behaviour_copy(policy)
    with torch.no_grad():
        assert float((engine(obs) - policy(obs)).abs().max()) > 0
    assert policy.activation_round is None and engine.activation_round is not None  # hooks read their own copy
    assert len(engine.FP8_WEIGHTS) == 14  # 2 layers × q, k, v, o, gate, up, down
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(engine.named_parameters())[name], dict(policy.named_parameters())[name])


def test_an_odd_width_is_refused_by_name():
    from pdm_lab.config import ConfigError

    problem = make_problem(TINY)
    with pytest.raises(ConfigError, match="hidden"):
        Qwen3Policy(problem.encoder, problem.prior, hidden=15)


def test_the_toy_audit_runs_the_probe_on_it():
    from pdm_lab.envs.audit.config import AuditConfig
    from pdm_lab.envs.audit.study import run_audit

    cfg = AuditConfig(problem=TINY, policy="qwen3", hidden=16, seeds=1, sequences=64, group_size=8, n_boot=50,
                      extra_rules=(), contexts=("shared",), mismatch="noise:1", delta=0.05, k=8, optimizer="adamw",
                      lr=1e-3, train_lr=1e-2, audit_at=(2,), flip_tokens=0, step_scales=(0.01,), probe_tokens=6)
    doc = run_audit(cfg)
    probe = doc["probe"]
    assert probe["probe/tokens"] > 0 and 0 < probe["probe/cos_kv_v"]["median"] < 1
    assert probe["probe/head_share"] is None  # tied: no output layer of its own
    assert "decomp/share/memory" in doc["decomposition"]["dppo_topk_kl"]
