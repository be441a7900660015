"""Shared pytest setup: the repo root on sys.path, and the distributed pools' teardown."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session", autouse=True)
def _dist_pools():
    """Close the persistent `dist_run` worker pools when the session ends."""
    yield
    from tests import harness

    harness.shutdown()
