"""How `grpoflow train` deals with Prefect, on the real Prefect API (the session's ephemeral server):
flow runs that the API still shows Running after their run ended while its server was down are set from
the store's record (flows/processes/prefect_api.py: settle_flow_runs), and the flow a CLI command runs
does not check its config a second time (flows/training/preflight.py: preflighted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpoflow.flows.config import GRPOConfig, load_config
from grpoflow.flows.processes.prefect_api import settle_flow_runs
from grpoflow.flows.training import preflight as pf
from grpoflow.storage.rollouts import RolloutStore

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-letters.yaml"


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


def test_the_flow_a_cli_command_runs_reuses_the_commands_preflight(prefect_api, monkeypatch, tmp_path):
    from prefect import flow

    checked = []
    real = pf.check_run
    monkeypatch.setattr(pf, "check_run", lambda cfg: (checked.append(cfg.learner.lr), real(cfg))[1])

    @flow(name="grpoflow-preflight-probe")
    def probe(config: GRPOConfig) -> int:  # a flow takes the config as grpo-train does: validated anew
        return len(pf.preflight(config, None))

    cfg = load_config(CONFIG, [f"storage.root={tmp_path}"])
    other = load_config(CONFIG, [f"storage.root={tmp_path}", "learner.lr=0.5"])
    rows = pf.preflight(cfg, None)  # what `grpoflow train` runs before the flow
    assert checked == [cfg.learner.lr] and rows
    with pf.preflighted(cfg, None, rows):
        assert probe(cfg) == len(rows)
        assert checked == [cfg.learner.lr]  # the flow's preflight returned the command's rows
        assert probe(other) == len(rows)  # another config is checked
        assert checked == [cfg.learner.lr, 0.5]
    assert probe(cfg) == len(rows)  # outside the block (a deployment's run): checked
    assert checked == [cfg.learner.lr, 0.5, cfg.learner.lr]
