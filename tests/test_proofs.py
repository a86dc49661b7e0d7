"""The proof suite (``pdm_lab.proofs``): every claim passes, a broken implementation is caught,
and ``pdm-lab prove`` writes its report and exits with the right status."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from pdm_lab import direction, policy_side
from pdm_lab.proofs import CLAIMS, run_proofs, select_claims
from pdm_lab.proofs.commands import prove, register
from pdm_lab.proofs.runner import run_claim


@pytest.mark.parametrize("name", list(CLAIMS))
def test_claim_passes(name):
    result = run_claim(CLAIMS[name], seed=0)
    assert result.passed, f"{result.verdict} {name}:\n{result.detail}"
    assert result.checks > 0


def test_claims_cover_spec():
    expected = {"kl_gradient_identity", "ddot_closed_form", "local_term_sign", "c_rewrite",
                "expectation_under_mu", "expectation_under_pi", "agg_exact_when_tail_at_most_one",
                "uniform_exact_when_pi_uniform_on_tail", "topk_exact_when_ratio_constant_on_tail",
                "topk_is_derivative_of_topk_kl", "k_must_be_in_support", "tail_sumsq_ordering",
                "agg_error_bound", "uniform_error_bound", "certified_interval", "topk_kl_nonnegative",
                "topk_kl_le_full_kl", "reverse_kl_derivative", "f_divergence_derivative",
                "tv_derivative", "ratio_test_first_order", "coupled_reduces_to_topk",
                "coupled_is_first_order_change", "ratio_test_kernel_invariant", "pdm_is_identity_kernel_case",
                "sign_step_fact", "unembedding_kernel_identity"}
    assert expected <= set(CLAIMS)


def _uniform_without_t(view):
    """A plausible bug: the paper's uniform tail without the division by t."""
    return direction._where_tail(view, view.pi_tail * (view.mu_tail - view.pi_tail))


def _topk_without_ratio(view):
    """A plausible bug: (μ_T − π_T)·S_T instead of (μ_T/π_T − 1)·S_T."""
    return direction._where_tail(view, (view.mu_tail - view.pi_tail) * torch.exp(view.pi_tail_log_sumsq))


@pytest.mark.parametrize("estimator, wrong, must_fail", [
    ("uniform", _uniform_without_t, {"uniform_exact_when_pi_uniform_on_tail", "uniform_error_bound"}),
    ("topk", _topk_without_ratio, {"topk_is_derivative_of_topk_kl", "topk_exact_when_ratio_constant_on_tail"}),
])
def test_broken_estimator_is_caught(monkeypatch, estimator, wrong, must_fail):
    monkeypatch.setitem(direction.DDOT_ESTIMATORS, estimator, wrong)
    report = run_proofs(only=",".join(must_fail) + ",agg_error_bound")
    failed = {r.name for r in report.failures}
    assert failed == must_fail, report.table()
    for result in report.failures:
        assert result.verdict == "FAIL"
        assert "instance: " in result.detail


def test_broken_backward_is_caught(monkeypatch):
    """policy_on_support's custom backward forgetting the 1/T factor fails the gradient identity."""
    backward = policy_side._SupportLogProb.backward

    def without_temperature(ctx, *grads):
        grad_logits, *rest = backward(ctx, *grads)
        return (grad_logits * ctx.temperature, *rest)

    monkeypatch.setattr(policy_side._SupportLogProb, "backward", staticmethod(without_temperature))
    report = run_proofs(only="kl_gradient_identity")
    assert not report.passed
    assert "T=" in report.failures[0].detail


def test_coupled_claim_fails_when_no_numeric_trial_can_run(monkeypatch):
    """A δ no token exceeds leaves the shared-parameter claim only its sympy part: a FAIL saying
    so, never a pass with the numeric half skipped."""
    from pdm_lab.proofs import coupled_direction

    monkeypatch.setattr(coupled_direction, "SHARED_DELTA", 1e6)
    result = run_claim(CLAIMS["coupled_is_first_order_change"], seed=0)
    assert result.verdict == "FAIL" and "0 of 3 numeric trials ran" in result.detail, result.detail


def test_kernel_claims_catch_a_probe_that_forgets_the_network(monkeypatch):
    """A kernel that returns v (as if K = I) fails the SPEC §6d claims that read K v."""
    from pdm_lab.audit import probe_kernel

    monkeypatch.setattr(probe_kernel.FunctionalKernel, "kernel_v", lambda self, rows, v, precondition=False: v.clone())
    report = run_proofs(only="ratio_test_kernel_invariant,unembedding_kernel_identity")
    assert {r.name for r in report.failures} == {"ratio_test_kernel_invariant", "unembedding_kernel_identity"}
    assert all(r.verdict == "FAIL" and " vs " in r.detail for r in report.failures)


def test_report_markdown(tmp_path):
    out = tmp_path / "nested" / "proofs.md"
    report = run_proofs(only="expectation", seed=3, out=out)
    assert report.passed and len(report.results) == 2
    text = out.read_text(encoding="utf-8")
    assert "| claim | method | verdict | checks | seconds |" in text
    assert "| `expectation_under_mu` |" in text and "Seed 3" in text


def test_select_claims():
    assert [c.name for c in select_claims("*_error_bound")] == ["agg_error_bound", "uniform_error_bound"]
    assert len(select_claims(None)) == len(CLAIMS)
    with pytest.raises(ValueError, match="matches no claim"):
        select_claims("no_such_claim")


def test_register_adds_prove_subcommand(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="pdm-lab")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["prove", "--only", "c_rewrite", "--seed", "2", "--out", str(tmp_path / "p.md")])
    assert args.func is prove and args.seed == 2
    assert args.func(args) == 0
    assert "c_rewrite" in capsys.readouterr().out
    assert (tmp_path / "p.md").exists()
    args = parser.parse_args(["prove", "--only", "no_such_claim"])
    assert args.func(args) == 2


def test_prove_exits_nonzero_and_shows_instance(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(direction.DDOT_ESTIMATORS, "uniform", _uniform_without_t)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["prove", "--only", "uniform_error_bound", "--out", str(tmp_path / "p.md")])
    assert prove(args) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "instance: " in captured.err
    assert "## Failures" in (tmp_path / "p.md").read_text(encoding="utf-8")


def test_cli_as_a_user_runs_it(tmp_path):
    out = tmp_path / "results" / "proofs.md"
    proc = subprocess.run(
        [sys.executable, "-m", "pdm_lab.cli.main", "prove", "--only", "c_rewrite,tail_sumsq", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2/2 claims pass" in proc.stdout
    text = out.read_text(encoding="utf-8")
    assert "| `c_rewrite` |" in text and "| `tail_sumsq_ordering` |" in text
