"""pdm_lab.proofs: every claim of SPEC §2–3b as a named sympy check that also runs the torch code.

Each claim is proved with sympy (symbolically for general n where sympy can, otherwise for every
small size, or by exhaustive small cases and random instances at 50 digits) and then pdm_lab's
own functions are evaluated in float64 on the same instances and compared with the 50-digit
reference, so a proof cannot pass while the code is wrong.

    from pdm_lab.proofs import run_proofs
    report = run_proofs(only="bound", seed=0, out="results/proofs.md")
    print(report.table())

Layout: ``registry`` (the ``@claim`` decorator), ``symbolic`` (sympy helpers), ``reference``
(mpmath side, no pdm_lab), ``implementation`` (the pdm_lab calls), the claim modules
``ddot_closed_form``, ``estimators``, ``bounds``, ``divergences``, ``other_measures``,
``coupled`` (SPEC §3b), then
``runner`` and ``cli`` (``pdm-lab prove``).
"""
from .registry import CLAIMS, Checker, ClaimFailed, claim
from .runner import ClaimResult, ProofReport, run_proofs, select_claims

__all__ = ["CLAIMS", "Checker", "ClaimFailed", "ClaimResult", "ProofReport", "claim", "run_proofs",
           "select_claims"]
