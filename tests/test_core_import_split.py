"""The mask library apart from the lab: ``import pdm_lab`` and the loss path load no audit, probe,
snapshot or lab module, and every public name still resolves."""
import subprocess
import sys

import pytest

LAB_PREFIXES = ("pdm_lab.audit", "pdm_lab.lab", "pdm_lab.envs", "pdm_lab.scaling", "pdm_lab.proofs", "pdm_lab.cli",
                "pdm_lab.integrations", "pdm_lab.tools", "pdm_lab.testing")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
                         check=True, capture_output=True, text=True).stdout
    return {m for m in out.split() if m.startswith("pdm_lab")}


@pytest.mark.parametrize("code", [
    "import pdm_lab",
    "from pdm_lab import pdm_policy_loss, MaskConfig, support_from_topk, policy_on_support, diagnose, DPInfo",
    "import pdm_lab.engine_topk, pdm_lab.padding, pdm_lab.sampling_mask, pdm_lab.reference_loss, pdm_lab.rollout_corr",
])
def test_the_library_loads_no_audit_or_lab_module(code):
    loaded = _modules_after(code)
    assert not [m for m in loaded if m.startswith(LAB_PREFIXES)], sorted(loaded)


def test_a_planted_eager_import_is_caught():
    """The check above can fail: the live audit config, as the top level once imported it."""
    loaded = _modules_after("import pdm_lab\nfrom pdm_lab import LiveAuditConfig")
    assert "pdm_lab.audit.live" in loaded and "pdm_lab.audit.snapshot" in loaded


def test_every_public_name_resolves_and_unknown_names_raise():
    import pdm_lab

    for name in pdm_lab.__all__:
        assert getattr(pdm_lab, name) is not None, name
    assert "pdm_policy_loss" in dir(pdm_lab)
    with pytest.raises(AttributeError, match="no attribute 'pdm_policy_los'"):
        pdm_lab.pdm_policy_los  # noqa: B018
    assert pdm_lab.masks.MASK_RULES is pdm_lab.MASK_RULES  # submodules resolve as attributes


def test_the_framework_rules_are_registered_however_the_registry_is_reached():
    loaded = subprocess.run([sys.executable, "-c", "from pdm_lab.masks import MASK_RULES; print(len(MASK_RULES), "
                             "'seq_geo_mean' in MASK_RULES)"], check=True, capture_output=True, text=True).stdout.split()
    assert loaded[1] == "True" and int(loaded[0]) > 20


def test_no_public_name_is_shadowed_by_a_submodule_of_the_same_name():
    """Importing ``pdm_lab.x`` binds ``x`` on the package: a public name equal to a module's name
    would then resolve to the module. Every top-level module imported first, every name is still its object."""
    import importlib
    import pkgutil
    import types

    import pdm_lab

    for info in pkgutil.iter_modules(pdm_lab.__path__):
        if not info.ispkg and info.name not in ("__main__",):
            importlib.import_module(f"pdm_lab.{info.name}")
    code = "\n".join(f"from pdm_lab import {name}" for name in pdm_lab.__all__)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the user's own import statements
    shadowed = [name for name in pdm_lab.__all__ if isinstance(scope[name], types.ModuleType)]
    assert not shadowed, shadowed
