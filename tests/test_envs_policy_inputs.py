"""The neural policy's sparse input path: W₁x as a sum of x's active rows, equal to the dense
product it replaces (float64), differentiable both ways, and the engine's copy unchanged."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, jvp

from pdm_lab.envs.problems.encoders import multi_hot
from pdm_lab.envs.problems.mismatch import Mismatch, engine_round
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.problems.problem import ProblemConfig, TokenMDPConfig, make_problem
from pdm_lab.envs.problems.rollout import RolloutRNG


def _setup(context_features: int, seed: int = 0):
    problem = make_problem(ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=16, max_len=6)))
    policy = make_policy("neural", problem.encoder, problem.prior, seed=seed, hidden=8, init_scale=0.5,
                         context_features=context_features).double()
    batch = problem.collect(policy, Mismatch(), 4, 4, RolloutRNG(seed))
    obs = batch.obs.reshape(-1, batch.obs.shape[-1])
    return policy, obs


def _dense_trainable(policy, obs):
    h = torch.tanh(policy.features(obs) @ policy.w1 + policy.b1)
    return h @ policy.w2 + policy.b2


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([0, 3, 64]), st.integers(0, 1000))
def test_sparse_input_equals_the_dense_product(context_features, seed):
    # F = 3 makes the three hashed bins collide often: a repeat must count once, as in x
    policy, obs = _setup(context_features, seed)
    index, value = policy.active_features(obs)
    assert torch.equal(multi_hot(index, policy.w1.shape[0]), policy.features(obs).float())
    torch.testing.assert_close(policy.trainable_logits(obs), _dense_trainable(policy, obs), rtol=0, atol=1e-13)


def test_sparse_input_gradients_and_jvp_match_the_dense_product():
    policy, obs = _setup(3)
    params = {k: v.detach() for k, v in policy.named_parameters()}
    tangent = {k: torch.randn_like(v) for k, v in params.items()}

    def sparse(p):
        return functional_call(policy, p, (obs,))

    def dense(p):
        h = torch.tanh(policy.features(obs) @ p["w1"] + p["b1"])
        return policy.prior[policy.encoder.prior_index(obs)].double() + h @ p["w2"] + p["b2"]
    torch.testing.assert_close(jvp(sparse, (params,), (tangent,))[1], jvp(dense, (params,), (tangent,))[1],
                               rtol=0, atol=1e-12)
    grads = [torch.autograd.grad(f({k: v.requires_grad_() for k, v in params.items()}).square().sum(),
                                 params["w1"]) for f in (sparse, dense)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


def test_engine_rounding_leaves_the_multi_hot_input_exact():
    # the engine's copy takes the dense product of the rounded x: rounding must not move a 0/1 input
    policy, obs = _setup(64)
    x = policy.features(obs).float()
    for kind in ("bf16_engine", "fp8_engine"):
        assert torch.equal(engine_round(kind)(x), x)


def test_input_key_groups_rows_by_their_network_input():
    policy, obs = _setup(3)
    key, x = policy.input_key(obs), policy.features(obs)
    same_key = (key[:, None, :] == key[None, :, :]).all(dim=2)
    same_x = (x[:, None, :] == x[None, :, :]).all(dim=2)
    assert torch.equal(same_key, same_x)
