"""From a toy to a run: the regime table and its knob (``calibrate``, SPEC §6b) and the
transfer comparison (``compare``, SPEC §6c). Imports ``audit`` and below."""
