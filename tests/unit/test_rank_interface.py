"""The network interface a learner rank's gloo/NCCL binds to (tasks/learner/distributed.py): the one
that holds the Ray node's address, found through psutil, or none."""

from __future__ import annotations

import sys

import pytest

from grpoflow.tasks.learner.distributed import _interface_of

pytestmark = [pytest.mark.unit, pytest.mark.skipif(sys.platform != "linux", reason="Linux names")]


def test_the_interface_holding_an_address_is_found_and_an_unheld_one_is_none():
    assert _interface_of("127.0.0.1") == "lo"  # Linux names its loopback interface so
    assert _interface_of("192.0.2.1") is None  # TEST-NET-1: held by no interface of this host
