"""TokenMDP: Gymnasium's checker, the MDP's rules, seeding, and the vector env against the scalar one."""
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given
from hypothesis import strategies as st

from pdm_lab.envs import ENV_ID
from pdm_lab.envs.problems.tasks import EOS, make_task
from pdm_lab.envs.problems.token_mdp import TokenMDP
from pdm_lab.envs.problems.token_mdp_vector import TokenMDPVectorEnv


@pytest.mark.parametrize("task", ["sum", "grammar"])
def test_check_env_passes(task):
    check_env(gym.make(ENV_ID, task=task).unwrapped, skip_render_check=True)
    check_env(gym.make(ENV_ID, task=task, render_mode="ansi").unwrapped)


def test_registered_vector_entry_point():
    venv = gym.make_vec(ENV_ID, num_envs=3, vectorization_mode="vector_entry_point")
    assert isinstance(venv.unwrapped, TokenMDPVectorEnv)
    obs, _ = venv.reset(seed=0)
    assert obs.shape == (3, 7) and venv.single_observation_space.contains(obs[0])


def test_sum_task_rewards_a_correct_answer_and_terminates():
    env = TokenMDP(task="sum", modulus=8)
    obs, _ = env.reset(options={"prompt": 5})
    assert obs[0] == 5 and (obs[1:] == env.task.pad).all()
    _, r, term, trunc, _ = env.step(8 + 5)  # value (8 + 5) mod 8 = 5
    assert (r, term, trunc) == (0.0, False, False)
    obs, r, term, trunc, _ = env.step(EOS)
    assert (r, term, trunc) == (1.0, True, False)
    assert list(obs[1:3]) == [13, EOS]
    with pytest.raises(RuntimeError):
        env.step(1)


def test_wrong_or_empty_answers_get_zero():
    env = TokenMDP(task="sum", modulus=8)
    env.reset(options={"prompt": 0})
    assert env.step(EOS)[1:3] == (0.0, True)  # empty answer: sum 0 = target, still rejected
    env.reset(options={"prompt": 3})
    env.step(1)
    assert env.step(EOS)[1] == 0.0


def test_budget_exhaustion_is_truncation_not_termination():
    env = TokenMDP(task="sum", max_len=4)
    env.reset(seed=0)
    for i in range(4):
        _, r, term, trunc, _ = env.step(1)
    assert (r, term, trunc) == (0.0, False, True)


def test_render_ansi_shows_prompt_response_and_reward():
    env = TokenMDP(task="sum", render_mode="ansi")
    env.reset(options={"prompt": 2})
    env.step(2)
    env.step(EOS)
    assert env.render() == "[sum] prompt 2 | 2 <eos>  -> reward 1"


def test_reset_seed_is_deterministic():
    a, b = TokenMDP(), TokenMDP()
    prompts_a = [a.reset(seed=7)[0][0]] + [a.reset()[0][0] for _ in range(20)]
    prompts_b = [b.reset(seed=7)[0][0]] + [b.reset()[0][0] for _ in range(20)]
    assert prompts_a == prompts_b
    assert len(set(prompts_a)) > 1


def test_grammar_dfa_is_never_stuck():
    task = make_task("grammar", task_seed=3)
    live = task.transition[: task.num_states, 1:] != task.num_states
    assert live.any(axis=1).all()


@given(task=st.sampled_from(["sum", "grammar"]), seed=st.integers(0, 2**16),
       num_envs=st.integers(1, 6))
def test_vector_env_matches_scalar_env_step_for_step(task, seed, num_envs):
    rng = np.random.default_rng(seed)
    venv = TokenMDPVectorEnv(num_envs, task=task, vocab_size=16, max_len=5)
    envs = [TokenMDP(task=task, vocab_size=16, max_len=5) for _ in range(num_envs)]
    prompts = rng.integers(venv.task.num_prompts, size=num_envs)
    obs, _ = venv.reset(seed=seed, options={"prompts": prompts})
    for i, env in enumerate(envs):
        np.testing.assert_array_equal(env.reset(options={"prompt": int(prompts[i])})[0], obs[i])
    # EOS is likely enough that both endings occur; after its first episode an env is left alone
    active = np.ones(num_envs, dtype=bool)
    for _ in range(6):
        actions = np.where(rng.random(num_envs) < 0.25, EOS, rng.integers(1, 16, size=num_envs))
        obs, reward, term, trunc, _ = venv.step(actions)
        for i in np.flatnonzero(active):
            s_obs, s_r, s_term, s_trunc, _ = envs[i].step(int(actions[i]))
            np.testing.assert_array_equal(s_obs, obs[i])
            assert (s_r, s_term, s_trunc) == (reward[i], term[i], trunc[i])
            if s_term or s_trunc:
                active[i] = False
        if not active.any():
            break


def test_vector_env_autoresets_on_the_next_step():
    venv = TokenMDPVectorEnv(2, task="sum")
    venv.reset(seed=0, options={"prompts": [1, 2]})
    _, _, term, _, _ = venv.step(np.array([EOS, 3]))
    assert term.tolist() == [True, False]
    obs, reward, term, trunc, _ = venv.step(np.array([5, 4]))
    assert reward[0] == 0 and not term[0] and not trunc[0]
    assert (obs[0, 1:] == venv.task.pad).all()  # fresh episode; the action was ignored
    assert obs[1, 1:3].tolist() == [3, 4]


def test_vector_env_rejects_bad_actions():
    venv = TokenMDPVectorEnv(2)
    venv.reset(seed=0)
    with pytest.raises(ValueError):
        venv.step(np.array([0, venv.task.vocab_size]))
    with pytest.raises(ValueError):
        venv.step(np.array([0]))
