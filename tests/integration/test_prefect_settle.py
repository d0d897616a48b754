"""Flow runs that a Prefect API still shows Running after their run ended while that API's server was
down (flows/processes/prefect_api.py: settle_flow_runs, which `grpoflow train` calls against a configured API):
set from the store's record, on the real Prefect API (the session's ephemeral server)."""

from __future__ import annotations

import pytest

from grpoflow.flows.processes.prefect_api import settle_flow_runs
from grpoflow.storage.rollouts import RolloutStore

pytestmark = pytest.mark.integration


def test_flow_runs_left_running_are_set_to_what_the_store_records(prefect_api, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Running

    @flow(name="grpoflow-settle-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        ids = [str(client.create_flow_run(probe, state=Running()).id) for _ in range(5)]
    store = RolloutStore(tmp_path)
    # "done": killed once (flow run 0, resumed by 1), then completed while the API was down
    store.write_run_meta("done", {"status": "completed", "flow_runs": ids[0:2]})
    store.write_run_meta("broke", {"status": "failed", "flow_runs": ids[2:3]})
    store.write_run_meta("live", {"status": "running", "flow_runs": ids[3:4]})  # still training
    store.write_run_meta("stopped", {"status": "cancelled", "flow_runs": ids[4:5]})

    assert sorted(settle_flow_runs(tmp_path)) == sorted([ids[0], ids[1], ids[2], ids[4]])
    with get_client(sync_client=True) as client:
        states = [client.read_flow_run(i).state for i in ids]
    assert [s.type for s in states] == [
        StateType.CRASHED,
        StateType.COMPLETED,
        StateType.FAILED,
        StateType.RUNNING,
        StateType.CANCELLED,
    ]
    assert "ended while this API could not be reached" in states[1].message
    assert settle_flow_runs(tmp_path) == []  # settled once: nothing is Running any more
