"""Shared pytest setup: the repo root on sys.path, the distributed pools' teardown, and
the opt-in `netns` tests (they build network namespaces as root: `pytest -m netns` or
SHARDC_NETNS=1 runs them; otherwise each is skipped with that reason)."""
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


NETNS_OPT_IN = ("network-namespace benchmark test, opt-in: run `pytest -m netns` (or set SHARDC_NETNS=1); "
                "it needs root, iproute2 and tc")


def pytest_collection_modifyitems(config, items):
    if "netns" in (config.option.markexpr or "") or os.environ.get("SHARDC_NETNS") == "1":
        return
    skip = pytest.mark.skip(reason=NETNS_OPT_IN)
    for item in items:
        if "netns" in item.keywords:
            item.add_marker(skip)
