"""Hypothesis settings of the property tests (``streams.profile``), and how many
examples each ran (printed at the end of the session).

- ``volley-properties``, the default lane: a few examples per test, derandomized (CI
  runs the same ones every time), no shrinking (each example runs Spark jobs), no
  example database.
- ``volley-properties-deep``, with ``VOLLEY_DEEP=1``: ``VOLLEY_DEEP_EXAMPLES`` (default
  40) random examples per test, shrunk when one fails (its seed and blob printed).

The names are this folder's own: registering Hypothesis's ``default`` profile would
reload it for the whole session, changing the suite's other Hypothesis tests."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.properties.streams import DEEP, EXAMPLES, PROFILE

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

settings.register_profile("volley-properties", max_examples=2, derandomize=True, database=None, deadline=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=_SLOW, print_blob=True)
settings.register_profile("volley-properties-deep", max_examples=int(os.environ.get("VOLLEY_DEEP_EXAMPLES", "40")),
                          database=None, deadline=None, suppress_health_check=_SLOW, print_blob=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if EXAMPLES:
        ran = ", ".join(f"{name}: {n}" for name, n in sorted(EXAMPLES.items()))
        terminalreporter.write_line(f"property examples run ({PROFILE}{', deep' if DEEP else ''}): {ran}")
