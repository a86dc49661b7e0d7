"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _default_dtype_is_restored():
    """A test (or a library it drives) that changes torch's default dtype must not change the
    next test's: the default is put back after every test, with a warning naming the change."""
    before = torch.float32  # torch's own default: a module that changes it at import changes it for all
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        import warnings
        warnings.warn(f"the test left torch's default dtype at {after} (was {before}); restored")


def pytest_collection_modifyitems(config, items):
    """Where compiling is known to miscompute (``pdm_lab.fast.compiled.lowered_isa``) the library
    runs eager, so a compiled-vs-eager test would compare eager with eager: it is skipped, saying why."""
    from pdm_lab.fast.compiled import lowered_isa

    reason = lowered_isa()
    if reason:
        skip = pytest.mark.skip(reason=f"compiled path off: {reason}")
        for item in items:
            if "compile" in item.keywords:
                item.add_marker(skip)
