"""The direction audit (SPEC §6): the measurement, apart from the mask library.

``measure`` (rates, regime table, verdicts), ``intervals`` (every confidence interval and test the
audit, transfer, reports and mechanism use), ``live`` (the audit of a real training step:
snapshot, one step per rule, restore), ``snapshot`` (the bit-exact host copy), ``probe`` and
``probe_kernel`` (SPEC §6d's own-update probe and its kernel), ``probe_record`` and
``central_difference``. ``import pdm_lab`` loads none of them.
"""
