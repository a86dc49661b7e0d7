"""Which framework versions each adapter is tested with, and the check that refuses the others."""
from __future__ import annotations

from importlib import metadata

#: Exact versions the CI tests run against (tests/frameworks); others are refused, not guessed at.
TESTED = {"trl": ("1.16.0",), "verl": ("0.9.1",)}

#: Set to 1 to run an adapter on an untested version anyway (at your own risk).
OVERRIDE_ENV = "PDM_LAB_ALLOW_UNTESTED"


class UntestedVersionError(RuntimeError):
    """The installed framework is not one the adapter was tested with."""


def require_version(package: str) -> str:
    """The installed version of `package`; raises if it is not in ``TESTED`` (unless overridden)."""
    import os

    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:
        raise UntestedVersionError(f"pdm_lab.integrations: {package} is not installed; "
                                   f"tested with {package}=={' or '.join(TESTED[package])} "
                                   f"(pip install 'pdm_lab[{package}]')") from None
    if installed not in TESTED[package] and os.environ.get(OVERRIDE_ENV) != "1":
        raise UntestedVersionError(
            f"pdm_lab.integrations.{package}: installed {package} {installed} is untested; this adapter "
            f"overrides {package} internals and is tested only with {package}=={' or '.join(TESTED[package])}. "
            f"Install a tested version, or set {OVERRIDE_ENV}=1 to try anyway.")
    return installed
