"""Session-wide fixtures shared by all tiers."""

from __future__ import annotations

import os

import pytest

# No telemetry from the test servers (there is no network here, and it races the SQLite writes).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def prefect_api():
    """The real Prefect API: one ephemeral server (temporary SQLite database) for the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
