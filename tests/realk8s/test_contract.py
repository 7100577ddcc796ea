"""The cluster port's contract suite, the Kubernetes adapter's run: the tests of
tests/cluster/test_contract.py, test_state.py, test_identity_records.py and
test_watch_contract.py (the simulated cluster runs them there), collected again here with a
``harness`` over the real control plane (``tests/realk8s/contract.py``: the adapter as the
control plane's service account under the shipped RBAC, real controllers and scheduler; Node
objects the admin writes, whose pods a stand-in kubelet starts and ends).

Each test gets a namespace of its own for the adapter (its state, serving and routing
objects); Nodes are cluster-wide, and each test deletes those it added. About a minute of the
tier's time (the same tests take seconds on the simulated cluster).
"""

from __future__ import annotations

import uuid

import pytest

from tests.cluster.test_contract import *  # noqa: F401,F403 - the contract's tests, collected here too
from tests.cluster.test_identity_records import *  # noqa: F401,F403
from tests.cluster.test_state import *  # noqa: F401,F403
from tests.cluster.test_watch_contract import *  # noqa: F401,F403


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:6]
