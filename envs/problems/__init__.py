"""Toy problems: the environments (Gymnasium token MDP and its vector twin, softmax bandit), their
tasks and encoders, the Zipf prior, the behaviour policy μ (``mismatch``) and batched rollouts.
Imports only the core (``pdm_lab``)."""
