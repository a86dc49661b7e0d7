"""The toy's supervised warm-up (``sft_steps``): cross-entropy on the policy's own accepted responses, so the
audited network is a trained one, as the loop's model is after its SFT."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.points import TrainedPolicies, training_key
from pdm_lab.envs.audit.sft import sft_on_accepted
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.problems.problem import ProblemConfig, TokenMDPConfig, make_problem

TINY = ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=32, max_len=6))


def tiny_policy(kind="transformer"):
    problem = make_problem(TINY)
    return problem, make_policy(kind, problem.encoder, problem.prior, hidden=16, init_scale=0.3)


def test_sft_raises_the_likelihood_of_accepted_responses_and_moves_the_network():
    problem, policy = tiny_policy()
    before = copy.deepcopy(policy.state_dict())
    record = sft_on_accepted(policy, problem, steps=30, lr=1e-2, groups=8, group_size=8)
    assert record["sft/steps"] == 30 and 0 < record["sft/accepted_first"] <= 1
    assert record["sft/nll_last"] < record["sft/nll_first"]
    assert not torch.equal(before["head"], policy.state_dict()["head"])
    assert torch.equal(before["prior"], policy.state_dict()["prior"])  # the pretrained prior stays frozen


def test_a_step_with_nothing_accepted_takes_no_optimiser_step(monkeypatch):
    problem, policy = tiny_policy()
    before = copy.deepcopy(policy.state_dict())
    real = problem.collect

    def rejected(*args, **kwargs):  # planted: every response rejected
        batch = real(*args, **kwargs)
        batch.rewards.zero_()
        return batch
    monkeypatch.setattr(problem, "collect", rejected)
    record = sft_on_accepted(policy, problem, steps=3, lr=1e-2, groups=4, group_size=4)
    assert record["sft/accepted_last"] == 0.0
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())


def test_the_trained_point_depends_on_sft_and_old_stores_stay_valid():
    base = AuditConfig(problem=TINY, policy="transformer", hidden=16, seeds=1, sequences=32, group_size=8,
                       extra_rules=(), train_groups=4)
    assert "sft_steps" not in json.loads(training_key(base))  # a store written before sft_steps is still read
    tuned = AuditConfig(**{**base.__dict__, "sft_steps": 2})
    assert json.loads(training_key(tuned))["sft_steps"] == 2
    problem = make_problem(TINY)
    plain = TrainedPolicies(base, problem).at(0, 0).state_dict()
    warmed = TrainedPolicies(tuned, problem).at(0, 0).state_dict()
    assert not torch.equal(plain["head"], warmed["head"])


def test_a_negative_sft_step_count_is_refused_by_name():
    from pdm_lab.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="sft_steps"):
        AuditConfig(problem=TINY, sft_steps=-1)
