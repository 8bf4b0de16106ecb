"""Hypothesis profiles, and the example budgets of the property tests.

Locally (the ``default`` profile) every run draws new inputs, and a property
test draws the budget it names with :func:`budget`. Under CI (``CI`` set: the
``ci`` profile) inputs are derandomized: every run draws the same ones, so a
red run reproduces and a green one stays green. Fixed inputs find nothing new
from one run to the next, so there a test draws a quarter of its budget (never
fewer than :data:`MIN_EXAMPLES`, nor more than it names). The ``ci-full``
profile (``HYPOTHESIS_PROFILE=ci-full``) draws the same fixed inputs with the
whole budgets.

How fast inputs are drawn depends on the machine's load, not on the code: the
speed health check would fail a busy run that a quiet one passes, so it is off
in every profile.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CI_SHARE = 4
MIN_EXAMPLES = 20

settings.register_profile("default", suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True, print_blob=True)
settings.register_profile("ci-full", parent=settings.get_profile("ci"))


def profile_name() -> str:
    """The profile this run uses: ``HYPOTHESIS_PROFILE``, else ``ci`` under CI, else ``default``."""
    return os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default")


def load() -> None:
    settings.load_profile(profile_name())


def budget(examples: int) -> int:
    """How many inputs a property test with a budget of ``examples`` draws in this run."""
    if profile_name() != "ci":
        return examples
    return min(examples, max(examples // CI_SHARE, MIN_EXAMPLES))
