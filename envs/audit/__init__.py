"""The direction audit of SPEC §6 on a toy: the study (``study``), its trained audit points
(``points``), the flip split (``flips``), its report sections (``report``) and the batch-aware
measure of SPEC §3b (``coupled``). Imports ``train`` and below."""
