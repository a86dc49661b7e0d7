"""What the lab's stages (``pdm_lab.envs``, ``pdm_lab.scaling``) share and the mask library does
not need: run records and results tables, locks and process lifetime, W&B logging, evidence
criteria for sweeps, advantages and quantisation helpers for the toys and the loop."""
