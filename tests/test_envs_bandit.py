"""Bandit, Zipf prior, samplers, GRPO advantages, policies."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdm_lab.envs.problems.bandit import BanditConfig, SoftmaxBandit
from pdm_lab.envs.problems.encoders import AutomatonEncoder
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.problems.prior import zipf_logits, zipf_tail_mass
from pdm_lab.envs.problems.problem import ProblemConfig, make_problem
from pdm_lab.lab.advantages import group_advantages
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.envs.problems.sampling import UniformPool, sample_from_cdf, sample_from_logits
from pdm_lab.envs.problems.tasks import make_task


def test_inverse_cdf_sampler_matches_the_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 0.0, -1.0, float("-inf"), 1.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    n = 200_000
    ids = sample_from_logits(logits.expand(n, -1), torch.rand(n, generator=gen, dtype=torch.float64))
    freq = torch.bincount(ids, minlength=5).double() / n
    assert freq[3] == 0  # a zero-probability token is never drawn
    assert torch.allclose(freq, probs.double(), atol=4 * math.sqrt(0.25 / n))


@given(st.lists(st.floats(-30, 30), min_size=2, max_size=40), st.floats(0, 1, exclude_max=True))
def test_sampler_never_returns_a_masked_token(values, u):
    logits = torch.tensor(values)
    logits[::2] = float("-inf")
    ids = sample_from_logits(logits[None], torch.tensor([u], dtype=torch.float64))
    assert torch.isfinite(logits[ids]).all()


def test_shared_cdf_sampler_agrees_with_per_row_sampler():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen)
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    u = torch.rand(6, generator=gen, dtype=torch.float64)
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)
    assert torch.equal(sample_from_cdf(cdf, rows, u), sample_from_logits(logits[rows], u))


def test_uniform_pool_is_a_deterministic_stream_whatever_the_chunking():
    a = UniformPool(torch.Generator().manual_seed(3), block=7)
    b = UniformPool(torch.Generator().manual_seed(3), block=7)
    xs = torch.cat([a.take(5), a.take(11), a.take(1)])
    assert torch.equal(xs, b.take(17))


def test_zipf_temperature_sets_the_tail_mass():
    gen = torch.Generator().manual_seed(0)
    masses = []
    for tau in (0.5, 2 / 3, 1.0):
        probs = torch.softmax(zipf_logits(4, 1000, temperature=tau, generator=gen), dim=-1)
        tail = 1 - probs.topk(20, dim=-1).values.sum(dim=-1)
        assert torch.allclose(tail, torch.full_like(tail, zipf_tail_mass(1000, 20, tau)), atol=1e-5)
        masses.append(float(tail[0]))
    assert masses == sorted(masses)


def test_zipf_fixed_top_token():
    logits = zipf_logits(5, 30, temperature=1.0, generator=torch.Generator().manual_seed(0), fixed_top=0)
    assert (logits.argmax(dim=-1) == 0).all()
    assert torch.equal(logits.sort(dim=-1).values, logits[:1].sort(dim=-1).values.expand(5, -1))


@pytest.mark.parametrize("reward", ["one_correct", "few_correct", "bernoulli", "gaussian"])
def test_bandit_reward_kinds(reward):
    bandit = SoftmaxBandit(BanditConfig(vocab_size=100, num_prompts=4, reward=reward, correct_rank=3))
    if reward == "one_correct":
        assert (bandit.mean_reward.sum(dim=1) == 1).all()
        best = bandit.mean_reward.argmax(dim=1)
        rank = (bandit.prior_logits > bandit.prior_logits.gather(1, best[:, None])).sum(dim=1)
        assert (rank == 2).all()  # the third favourite of the prior
    if reward == "few_correct":
        assert (bandit.mean_reward.sum(dim=1) == 3).all()
    n = 20_000
    prompts = torch.zeros(n, dtype=torch.int64)
    tokens = torch.full((n,), int(bandit.mean_reward[0].argmax()))
    r = bandit.rewards(prompts, tokens, torch.rand(n, dtype=torch.float64))
    assert abs(float(r.mean()) - float(bandit.mean_reward[0].max())) < 0.05


def test_bandit_expected_reward_is_exact():
    problem = make_problem(ProblemConfig(kind="bandit"))
    policy = make_policy("tabular", problem.encoder, problem.prior)
    expected = problem.evaluate(policy)
    probs = torch.softmax(problem.prior, dim=-1)
    assert expected == pytest.approx(float((probs * problem.bandit.mean_reward).sum(dim=-1).mean()))


@given(st.lists(st.lists(st.floats(-5, 5), min_size=2, max_size=6), min_size=1, max_size=5))
def test_group_advantages_are_centred_and_zero_for_flat_groups(groups):
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float32)
    ids = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    adv = group_advantages(rewards, ids)
    for i, g in enumerate(groups):
        a = adv[ids == i]
        assert abs(float(a.sum())) < 1e-3 * max(1.0, float(a.abs().max()))
        if max(g) == min(g):
            assert (a == 0).all()


def test_automaton_encoder_recovers_the_running_state():
    task = make_task("sum", vocab_size=16, modulus=4, max_len=5)
    enc = AutomatonEncoder(task)
    pad = task.pad
    obs = torch.tensor([[3, 1, 2, pad, pad, pad], [0, pad, pad, pad, pad, pad]])
    # prompt 3, running sum (1 + 2) mod 4 = 3, position 2  |  prompt 0, sum 0, position 0
    assert enc.state_index(obs).tolist() == [(3 * 4 + 3) * 5 + 2, 0]
    assert enc.features(obs).shape == (2, 4 + 4 + 5)


def _scan_reference(task, obs: torch.Tensor) -> torch.Tensor:
    """The running automaton state by its definition: one transition per slot, padding a no-op."""
    q = []
    for row in obs.tolist():
        state = int(task.start[row[0]])
        for token in row[1:]:
            state = state if token == task.pad else int(task.transition[state, token])
        q.append(state)
    return torch.tensor(q)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=12), st.integers(0, 2 ** 16))
def test_automaton_scan_resumed_across_calls_equals_the_scan_from_slot_one(moves, seed):
    """The encoder resumes a row's scan from its previous call when only slots were appended (a
    rollout); every other change (a reset row, an edited slot, another batch) is rescanned. Over
    any sequence of such calls its state equals the plain scan of each observation alone."""
    task = make_task("grammar", vocab_size=12, num_states=4, max_len=6)
    enc = AutomatonEncoder(task)
    gen = torch.Generator().manual_seed(seed)
    obs = torch.full((5, task.obs_len), task.pad, dtype=torch.int64)
    obs[:, 0] = torch.randint(task.num_prompts, (5,), generator=gen)
    for kind, row in moves:
        obs, row = obs.clone(), row % obs.shape[0]
        written = int((obs[row, 1:] != task.pad).sum())
        if kind == 0 and written < task.max_len:  # append a slot to one row (a rollout's step)
            obs[row, 1 + written] = int(torch.randint(task.vocab_size, (1,), generator=gen))
        elif kind == 1:  # the row restarts on a new prompt (the vector env's autoreset)
            obs[row] = task.pad
            obs[row, 0] = int(torch.randint(task.num_prompts, (1,), generator=gen))
        elif kind == 2 and written:  # an earlier slot edited: the resume must notice
            obs[row, 1 + int(torch.randint(written, (1,), generator=gen))] = int(
                torch.randint(task.vocab_size, (1,), generator=gen))
        elif kind == 3:  # another batch shape: a fresh scan
            obs = obs[: row + 1]
        q = enc._summary(obs)[1]
        assert torch.equal(q, _scan_reference(task, obs)), (kind, row, obs)


@pytest.mark.parametrize("kind", ["bandit", "token_mdp"])
@pytest.mark.parametrize("policy", ["tabular", "neural"])
def test_rollout_batches_are_consistent_and_seeded(kind, policy):
    problem = make_problem(ProblemConfig(kind=kind))
    pol = make_policy(policy, problem.encoder, problem.prior)
    a = problem.collect(pol, Mismatch.parse("noise:0.5"), 4, 8, RolloutRNG(5))
    b = problem.collect(pol, Mismatch.parse("noise:0.5"), 4, 8, RolloutRNG(5))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.rewards, b.rewards)
    assert a.tokens.shape == a.response_mask.shape == (32, problem.horizon)
    assert a.mu_logp.shape == (32, problem.horizon, problem.vocab_size)
    assert torch.allclose(a.mu_logp.exp().sum(-1), torch.ones(32, problem.horizon), atol=1e-4)
    assert a.response_mask[:, 0].all()
    assert a.groups.tolist() == [g for g in range(4) for _ in range(8)]
    # the sampled token has positive behaviour probability
    lp = a.mu_logp.gather(2, a.tokens[..., None])[..., 0]
    assert torch.isfinite(lp[a.response_mask]).all()


def test_neural_policy_couples_states_tabular_does_not():
    problem = make_problem(ProblemConfig(kind="bandit"))
    obs = torch.arange(3)[:, None]
    for kind, coupled in (("tabular", False), ("neural", True)):
        pol = make_policy(kind, problem.encoder, problem.prior)
        before = pol(obs).detach()
        opt = torch.optim.SGD(pol.parameters(), lr=1.0)
        (-torch.log_softmax(pol(obs[:1]), dim=-1)[0, 5]).backward()  # push token 5 in state 0 only
        opt.step()
        moved = (pol(obs).detach() - before).abs().amax(dim=1)
        assert moved[0] > 0
        assert bool((moved[1:] > 0).all()) == coupled
