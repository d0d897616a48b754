"""Several generation servers: routing, health and revival bookkeeping (tasks/rollouts/replicas.py), core shares
and the config's server fields. The servers here are bookkeeping only: `load` and `is_healthy` are
recorders standing in for the flow's real ones (a real reload needs a vLLM server; the integration
tests run two real ones)."""

from __future__ import annotations

import threading

import pytest

from grpoflow.flows.config import ConfigError, load_config
from grpoflow.flows.processes.serve import core_shares
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.replicas import MAX_RESTARTS, Replica, ReplicaSet
from tests.support import wait_for

pytestmark = pytest.mark.unit


def servers(n: int, **kw) -> ReplicaSet:
    return ReplicaSet([Replica(i, f"http://127.0.0.1:{9000 + i}") for i in range(n)], **kw)


def wait_until(cond, timeout_s: float = 5.0) -> None:
    wait_for(cond, timeout_s, "the replica set's threads", interval_s=0.01)


def test_groups_go_to_the_server_with_the_fewest_in_flight():
    s = servers(3)
    picked = [s.pick().index for _ in range(6)]  # none finishes: in-flight counts decide
    assert picked == [0, 1, 2, 0, 1, 2]
    for i in (1, 1):
        s.done(s.replicas[i], ok=True)
    assert s.pick().index == 1  # now the least busy
    # equal in flight: the one that has served fewer goes first
    t = servers(2)
    a = t.pick()
    t.done(a, ok=True)
    assert t.pick().index == 1


def test_a_down_server_leaves_the_rotation_and_none_left_is_a_clear_error():
    s = servers(2)
    s.down(s.replicas[0], InferenceUnavailableError("connection refused"))
    assert [s.pick().index for _ in range(3)] == [1, 1, 1]
    s.down(s.replicas[1], InferenceUnavailableError("timed out"))
    with pytest.raises(InferenceUnavailableError) as e:
        s.pick()
    msg = str(e.value)
    assert (
        "all 2 vLLM servers are down" in msg
        and ":9000: connection refused" in msg
        and ":9001: timed out" in msg
    )
    assert s.metrics()["gen/servers_up"] == 0.0 and s.metrics()["gen/server0/failures"] == 1.0


def test_an_external_server_rejoins_when_it_answers_at_the_current_weights():
    s = servers(2, version=3, weights_path="/w/v3")
    answering, loads, polls = threading.Event(), [], []
    s.is_healthy = lambda url: polls.append(url) or answering.is_set()
    s.load = lambda rep, path, version: (loads.append((rep.index, path, version)), rep.versions.set(version))
    s.poll_s = 0.01
    rep = s.replicas[1]
    rep.versions.set(2)  # it missed a push
    s.down(rep, InferenceUnavailableError("gone"))
    wait_until(lambda: len(polls) >= 3)
    assert not rep.healthy and loads == []  # not answering: polled, nothing loaded
    answering.set()
    wait_until(lambda: rep.healthy)
    assert loads == [(1, "/w/v3", 3)] and rep.versions.get() == 3
    s.close()


def test_a_server_rejoins_only_after_a_push_under_way_and_at_its_version():
    s = servers(2, version=1, weights_path="/w/v1")
    polls, loads = [], []
    s.is_healthy = lambda url: polls.append(url) or True
    s.load = lambda rep, path, version: (loads.append(version), rep.versions.set(version))
    s.poll_s = 0.01
    targets = s.begin_push()  # a push to the servers up now
    assert [r.index for r in targets] == [0, 1]
    s.replicas[1].versions.set(0)  # behind: rejoining during the push would load v1 (`loads` shows it)
    s.down(s.replicas[1], InferenceUnavailableError("reload failed"))
    wait_until(lambda: polls)  # the reviver found it answering
    assert not s.replicas[1].healthy  # it waits for the push to end
    s.end_push(2, "/w/v2")
    wait_until(lambda: s.replicas[1].healthy)
    assert loads == [2] and s.replicas[1].versions.get() == 2 and s.version == 2
    s.close()


def test_an_embedded_server_is_restarted_and_given_up_on_after_its_restarts():
    s = servers(2)
    s.poll_s = 0.01
    s.load = lambda rep, path, version: rep.versions.set(version)
    calls = []

    def crash_loop():
        calls.append(1)
        raise RuntimeError("exited during start-up")

    s.replicas[0].restart = crash_loop
    s.replicas[1].restart = lambda: None
    s.down(s.replicas[0], InferenceUnavailableError("killed"))
    wait_until(lambda: s.replicas[0].gave_up)
    assert len(calls) == MAX_RESTARTS and "gave up after" in s.replicas[0].down_reason
    s.down(s.replicas[1], InferenceUnavailableError("killed"))  # restarts fine: back in the rotation
    assert s.wait_any_up(5.0) and s.replicas[1].healthy and s.replicas[1].restarts == 1
    s.close()


def test_a_restarted_server_loads_the_current_weights_even_at_its_old_version():
    """A restarted embedded server serves the model it starts with: that its version box still reads
    the current version (no push while it was down) must not skip the load."""
    s = servers(2, version=4, weights_path="/w/v4")
    loads = []
    s.load = lambda rep, path, version: (loads.append((rep.index, path, version)), rep.versions.set(version))
    s.poll_s = 0.01
    s.replicas[0].restart = lambda: None
    s.down(s.replicas[0], InferenceUnavailableError("killed"))
    wait_until(lambda: s.replicas[0].healthy)
    assert loads == [(0, "/w/v4", 4)] and s.replicas[0].restarts == 1
    s.close()


def test_wait_any_up_says_no_when_every_server_is_given_up():
    s = servers(1)
    s.poll_s = 0.01
    s.load = lambda rep, path, version: None
    s.replicas[0].restart = lambda: (_ for _ in ()).throw(RuntimeError("no"))
    s.down(s.replicas[0], InferenceUnavailableError("killed"))
    assert s.wait_any_up(5.0) is False
    s.close()


def test_core_shares():
    assert core_shares(2, {0, 1}) == [frozenset({0}), frozenset({1})]
    assert core_shares(2, {0, 1, 2, 3}) == [frozenset({0, 1}), frozenset({2, 3})]
    assert core_shares(3, {4, 5}) == [frozenset({4}), frozenset({5}), frozenset({4})]
    assert core_shares(1, {0, 1}) == [frozenset({0, 1})]


@pytest.mark.parametrize(
    "sets, field",
    [
        (["inference.url=http://127.0.0.1:8000", "inference.urls=[http://127.0.0.1:8001]"], "inference.urls"),
        (["inference.url=http://127.0.0.1:8000", "inference.replicas=2"], "inference.replicas"),
        (["inference.urls=[http://127.0.0.1:8001, http://127.0.0.1:8001]"], "duplicate"),
        (["inference.replicas=0"], "inference.replicas"),
    ],
)
def test_server_fields_are_checked(sets, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert field in str(e.value)


def test_external_servers_are_url_or_urls():
    assert load_config(None, ["inference.url=http://127.0.0.1:8000"]).inference.external() == [
        "http://127.0.0.1:8000"
    ]
    cfg = load_config(None, ["inference.urls=[http://127.0.0.1:8000, http://127.0.0.1:8001]"])
    assert cfg.inference.external() == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert load_config(None, []).inference.external() == []


def test_a_server_that_fails_again_after_rejoining_is_revived_again():
    s = servers(2, version=1, weights_path="/w/v1")
    s.is_healthy = lambda url: True
    loads = []
    s.load = lambda rep, path, version: (loads.append(version), rep.versions.set(version))
    s.poll_s = 0.01
    rep = s.replicas[0]
    for _ in range(2):
        rep.versions.set(0)  # it lost its weights (a restart of the server behind the URL)
        s.down(rep, InferenceUnavailableError("gone"))
        wait_until(lambda: rep.healthy)
    assert loads == [1, 1] and rep.failures == 2
    s.close()
