"""Shared pytest setup: the repo root on sys.path, the distributed pools' teardown, the
opt-in `netns` tests (they build network namespaces as root: `pytest -m netns` or
SHARDC_NETNS=1 runs them; otherwise each is skipped with that reason), and Inductor's
compile on one thread (TORCHINDUCTOR_COMPILE_THREADS=1, unless set): every gloo rank of a
test compiles its own graphs, and with the default each rank starts a pool of compile
worker processes of its own, up to 8 ranks x 2 workers importing torch on a 2-core machine."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")       # before torch is imported (see above)
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
