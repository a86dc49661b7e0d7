"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
