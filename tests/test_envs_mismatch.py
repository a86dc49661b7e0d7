"""Mismatch injection: parsing, composition, and the ordering of realised mismatch with strength."""
import pytest
import torch

from pdm_lab.mask_config import MaskConfig
from pdm_lab.envs.problems.mismatch import DTYPES, TAIL_NOISE_TOP, Mismatch, MismatchSource, round_through
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.problems.prior import zipf_logits
from pdm_lab.envs.problems.problem import ProblemConfig, make_problem
from pdm_lab.envs.train.grpo import TrainConfig, train


def _logits():
    return zipf_logits(128, 500, temperature=1.0, generator=torch.Generator().manual_seed(0))


def full_kl(z_mu, z_pi):
    lm, lp = torch.log_softmax(z_mu, -1), torch.log_softmax(z_pi, -1)
    return float((lm.exp() * (lm - lp)).sum(-1).mean())


def realised(spec, z=None):
    z = _logits() if z is None else z
    return full_kl(Mismatch.parse(spec).behaviour_logits(z, torch.Generator().manual_seed(1)), z)


def test_parse_and_str_round_trip():
    m = Mismatch.parse("fp8_e4m3_weights:0+noise:0.3+stale:4")
    assert str(m) == "fp8_e4m3_weights:0+noise:0.3+stale:4"
    assert Mismatch.parse(str(m)) == m
    assert m.stale_steps == 4 and m.stochastic
    assert str(Mismatch.parse("none")) == "none" and Mismatch.parse("") == Mismatch()


@pytest.mark.parametrize("bad", ["noize:1", "stale:0.5", "noise:-1", "temperature:-1"])
def test_bad_specs_raise_with_the_valid_kinds(bad):
    with pytest.raises(ValueError):
        Mismatch.parse(bad)


def test_no_mismatch_is_exactly_pi():
    z = _logits()
    assert torch.equal(Mismatch().behaviour_logits(z, torch.Generator()), z)
    problem = make_problem(ProblemConfig(kind="bandit"))
    pol = make_policy("neural", problem.encoder, problem.prior)
    assert Mismatch.parse("noise:1").behaviour_copy(pol) is pol  # logit kinds leave weights alone


@pytest.mark.parametrize("kind, strengths", [
    ("noise", [0.0, 0.1, 0.3, 1.0, 2.0]),
    ("tail_noise", [0.0, 0.3, 1.0, 3.0]),
    ("temperature", [0.0, 0.1, 0.3, 1.0]),
    ("bf16", [16, 64, 256, 1024]),
    ("fp16", [64, 256, 1024, 4096]),
    ("fp8_e4m3", [16, 64, 256]),  # monotone once m exceeds the logits themselves
    ("fp8_e5m2", [16, 32, 64]),  # saturates beyond (μ near uniform on the head)
])
def test_realised_mismatch_grows_with_strength(kind, strengths):
    values = [realised(f"{kind}:{s:g}") for s in strengths]
    if kind in ("noise", "tail_noise", "temperature"):
        assert values[0] == 0.0  # strength 0 is no mismatch
    assert all(a < b for a, b in zip(values, values[1:])), values


def test_precision_ordering_by_mantissa_bits():
    # same magnitude, fewer mantissa bits -> more mismatch: fp16 (10) < bf16 (7) < e4m3 (3) < e5m2 (2)
    for m in (0, 16):
        values = [realised(f"{d}:{m}") for d in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")]
        assert values == sorted(values) and values[0] < values[-1]


@pytest.mark.parametrize("policy", ["tabular", "neural"])
def test_weight_rounding_orders_like_the_formats(policy):
    problem = make_problem(ProblemConfig(kind="bandit"))
    pol = make_policy(policy, problem.encoder, problem.prior)
    obs = torch.arange(problem.bandit.num_prompts)[:, None]
    z = pol(obs).detach()
    values = []
    for d in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        engine = Mismatch.parse(f"{d}_weights:0").behaviour_copy(pol)
        assert engine is not pol
        values.append(full_kl(engine(obs).detach(), z))
    assert values == sorted(values) and values[0] > 0
    assert torch.equal(pol(obs).detach(), z)  # the trainer's copy is untouched


def test_round_through_is_a_real_cast():
    x = torch.linspace(-10, 10, 101)
    for name, dtype in DTYPES.items():
        q = round_through(x, dtype, 0.0, per_row=False)
        assert torch.isfinite(q).all()
        if name in ("bf16", "fp16"):
            assert torch.equal(q, x.to(dtype).float())
    big = round_through(torch.tensor([1e6, -1e6]), torch.float16, 0.0, per_row=False)
    assert torch.isfinite(big).all()  # saturates instead of overflowing to inf


def test_tail_noise_leaves_the_top_tokens_alone():
    z = _logits()
    zm = Mismatch.parse("tail_noise:3").behaviour_logits(z, torch.Generator().manual_seed(0))
    top = z.topk(TAIL_NOISE_TOP, dim=-1).indices
    assert torch.equal(zm.gather(1, top), z.gather(1, top))
    assert not torch.equal(zm, z)


def test_composition_applies_every_source():
    assert realised("noise:0.5+temperature:0.5") > max(realised("noise:0.5"), realised("temperature:0.5")) * 0.9
    assert MismatchSource("stale", 3).strength == 3


def test_staleness_shows_up_at_update_time_and_grows():
    base = TrainConfig(problem=ProblemConfig(kind="bandit"), steps=3, groups_per_step=16,
                       group_size=8, track_unsafe_keep=False, lr=0.3,
                       mask=MaskConfig(rule="none"))
    seen = []
    for s in (1, 4, 16):
        out = train(TrainConfig(**{**base.__dict__, "mismatch": f"stale:{s}"}))
        assert out["realised_topk_kl_mean"] < 1e-5  # μ = π at rollout time
        seen.append(out["update_topk_kl_mean"])
    assert seen[0] < 1e-5 < seen[1] < seen[2]


def test_engine_kinds_round_weights_and_activations_like_an_engine():
    import torch

    from pdm_lab.envs.problems.encoders import BanditEncoder
    from pdm_lab.envs.problems.mismatch import Mismatch
    from pdm_lab.envs.policies.models import NeuralPolicy
    from pdm_lab.lab.quantize import quantize_dequantize

    gen = torch.Generator().manual_seed(0)
    prior = torch.randn(8, 300, generator=gen) * 3 + 25.0  # an LLM's logit level
    policy = NeuralPolicy(BanditEncoder(8), prior, hidden=16, generator=gen, init_scale=0.5)
    obs = torch.arange(8)[:, None]
    for kind in ("bf16_engine", "fp8_engine"):
        engine = Mismatch.parse(f"{kind}:0").behaviour_copy(policy)
        assert engine is not policy and policy.activation_round is None
        z, z_engine = policy(obs), engine(obs)
        assert torch.equal(z_engine, engine(obs))  # deterministic: the same context, the same μ
        err = (z_engine - z).abs().max()
        assert 0 < err < 0.5  # bf16 at |z| ≈ 25 rounds to a spacing of 0.125
        assert torch.equal(engine.prior, prior.to(torch.bfloat16).float())  # output side stays bf16
    engine = Mismatch.parse("fp8_engine:0").behaviour_copy(policy)
    assert torch.equal(engine.w1, quantize_dequantize(policy.w1))  # the scaling stage's block formula


def test_scaling_fp8_uses_the_core_formula():
    from pdm_lab.lab import quantize
    from pdm_lab.scaling import fp8

    assert fp8.quantize_dequantize is quantize.quantize_dequantize
    assert fp8.quantize_blockwise is quantize.quantize_blockwise


def test_lognormal_spec_and_bad_tail():
    import pytest

    from pdm_lab.envs.problems.mismatch import Mismatch

    m = Mismatch.parse("bf16_engine:0+lognormal:0.06:1.5")
    assert str(m) == "bf16_engine:0+lognormal:0.06:1.5" and m.sources[1].tail == 1.5
    with pytest.raises(ValueError, match="lognormal and outlier only"):
        Mismatch.parse("noise:1:2")
