"""The resumable grid of toy runs (``grid``) and the executors that run its cells (``executors``).
Imports ``train`` and below."""
