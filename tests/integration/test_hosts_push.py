"""A vLLM deployment on another host with no shared filesystem (issue 46): the learner and its store on
this machine's own namespace, a `grpoflow serve` server (the real vLLM CPU server, LoRA on) on a
second host (tests/hosts.py: a network namespace on a bridge) in a mount namespace where the learner's
store is an empty read-only tmpfs. Every push of a run reaches it over the network (`sync.transport`
auto: the server's probe finds the store unreadable), full weights and LoRA adapters alike; a learner
killed mid-upload leaves it serving the last whole version, and the next push goes through. bf16 runs
send what changed (`sync.delta`), and a delta cut off mid-upload leaves the version before it served.
Last, the whole second host dies mid-run (a bf16 run on it and on the session's local server): the run
goes on on the local one, and when the host is back the server rejoins at the served version, sent over
the network, and takes deltas again."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpoflow.flows.processes.serve import upload_dir_of
from grpoflow.storage.sql import query
from grpoflow.tasks.rollouts.inference import VLLMClient
from tests.hosts import Host
from tests.support import REPO, Samples, hosts_fixture, logprob_gap, served_samples, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.memory_heavy]
KEY, PORT, STEPS = "hosts-push-key", 8765, 3
# Seeded sampling prompts of the tiny byte-level model.
PROBES = [[3 + (7 * i + 13 * k) % 90 for k in range(6 + 5 * i)] for i in range(3)]

one_host = hosts_fixture(1, scope="module")


@dataclass
class Remote:
    """`grpoflow serve` on the second host, the learner's store hidden from it."""

    host: Host
    url: str
    store: Path  # the learner's
    uploads: Path  # the server's upload dir, on its own disk
    root: Path  # the server's store root

    def start(self, tiny_model_dir: Path) -> None:
        """Start `grpoflow serve` there (as a machine's service manager would at boot); wait for it."""
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own Prefect API
        env |= {"PREFECT_HOME": str(self.root / "prefect-home"), "GRPOFLOW_API_KEY": KEY}
        cmd = [sys.executable, "-m", "grpoflow.flows.cli.main", "serve", "--model", str(tiny_model_dir),
               "--lora-rank", "8", "--host", self.host.address, "--port", str(PORT), "--root", str(self.root)]  # fmt: skip
        with open(self.root / "serve.log", "ab") as log:  # the server keeps its own descriptor
            proc = self.host.run(
                cmd, hide=[self.store], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(lambda: _healthy(self.url, proc), 600, "grpoflow serve on the second host",
                 why=lambda: (self.root / "serve.log").read_text(errors="replace")[-3000:])  # fmt: skip


@pytest.fixture(scope="module")
def remote(one_host, tiny_model_dir, tmp_path_factory, prefect_api) -> Remote:
    (host,) = one_host
    root = tmp_path_factory.mktemp("server-root")
    out = Remote(host, host.url(PORT), tmp_path_factory.mktemp("learner-store"),
                 upload_dir_of(root, f"serve-{PORT}"), root)  # fmt: skip
    out.start(tiny_model_dir)
    # The hiding is real: the server's host sees an empty directory where the store is.
    assert host.check_output(["ls", "-A", str(out.store)], hide=[out.store]) == ""
    return out


def _healthy(url: str, proc) -> bool:
    assert proc.poll() is None, f"grpoflow serve exited ({proc.returncode})"
    try:
        return asyncio.run(_on(url, lambda c: c.health()))
    except Exception:
        return False


async def _on(url: str, call):
    async with VLLMClient(url, api_key=KEY, retries=0) as c:
        return await call(c)


def train(store: Path, run_id: str, url: str, *extra: str, resume: bool = False, env_extra=None):
    from prefect.settings import PREFECT_API_URL

    sets = [f"storage.root={store}", f"inference.url={url}", f"inference.api_key={KEY}",
            f"run.steps={STEPS}", *extra]  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "grpoflow.flows.cli.main",
        "train",
        *(["--resume"] if resume else ["--run-id"]),
        run_id,
    ]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), **(env_extra or {})}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def pushes(store: Path, run_id: str) -> list[tuple]:
    _, rows = query(store, f"""SELECT "sync/version", "sync/network_servers", "sync/upload_bytes"
        FROM steps WHERE run_id = '{run_id}' AND "sync/version" IS NOT NULL ORDER BY step""")  # fmt: skip
    return rows


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def served(url: str, model: str | None = None) -> Samples:
    return served_samples(url, PROBES, model=model, api_key=KEY, max_tokens=12, seed=9)


gap = logprob_gap


def load(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def test_a_lora_run_sends_its_adapters_to_a_server_that_cannot_read_the_store(remote, tiny_model_dir):
    from peft import PeftModel

    url, store, uploads = remote.url, remote.store, remote.uploads
    out = train(store, "far-lora", url, f"model.path={tiny_model_dir}", "learner.lora={rank: 8, alpha: 16}")
    assert out.returncode == 0, out.stderr[-3000:]
    meta = json.loads((store / "runs" / "far-lora.json").read_text())
    assert meta["transports"] == {url: "network"}
    kept = sorted(p.name for p in (store / "weights" / "far-lora").glob("v*"))
    # Every push went over the network, the adapter's bytes and nothing more, one server each time.
    rows = pushes(store, "far-lora")
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)) and all(r[1] == 1 for r in rows)
    last = store / "weights" / "far-lora" / kept[-1]
    assert rows[-1][2] == size(last)
    # The server's disk holds what the learner keeps (sync.keep_last), and it serves the last adapter
    # from there: what it generates under it is the base with that adapter merged.
    assert sorted(p.name for p in (uploads / "far-lora").iterdir()) == kept
    models = asyncio.run(_on(url, lambda c: c.models()))
    (card,) = [m for m in models if m["id"] == f"far-lora@v{STEPS}"]
    assert Path(card["root"]) == uploads / "far-lora" / kept[-1]
    merged = PeftModel.from_pretrained(load(tiny_model_dir), str(last)).merge_and_unload()
    assert gap(merged, served(url, f"far-lora@v{STEPS}")) < 1e-3
    # Promotion into the live server, as a LoRA lineage: the checkpoint's adapter goes over the network
    # too, and the lineage's name serves it.
    from grpoflow.flows.lineage.promote import checkpoint_version, promote
    from grpoflow.tasks.config.inference import InferenceConfig

    candidate = checkpoint_version(store, "far-lora")
    promote(store, "far-lora", candidate, incumbent=None, server_url=url, inference=InferenceConfig(api_key=KEY),
            reason="test")  # fmt: skip
    (sent,) = (uploads / "far-lora@lineage").iterdir()
    assert (sent / "adapter_model.safetensors").read_bytes() == (
        Path(candidate["path"]) / "adapter_model.safetensors"
    ).read_bytes()
    assert gap(merged, served(url, "far-lora")) < 1e-3  # the checkpoint holds the last version's adapter


def test_a_full_weights_run_reloads_each_version_from_the_servers_own_disk(remote, tiny_model_dir):
    url, store, uploads = remote.url, remote.store, remote.uploads
    out = train(store, "far-full", url, f"model.path={tiny_model_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = pushes(store, "far-full")
    kept = sorted(p.name for p in (store / "weights" / "far-full").glob("v*"))
    last = store / "weights" / "far-full" / kept[-1]
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)) and all(r[1] == 1 for r in rows)
    assert rows[-1][2] == size(last) > 0
    assert sorted(p.name for p in (uploads / "far-full").iterdir()) == kept
    answers = served(url)
    assert gap(load(last), answers) < 1e-3  # it serves the run's last weights
    assert gap(load(tiny_model_dir), answers) > 1e-2  # which are not the base's


def test_a_bf16_run_sends_each_version_after_the_first_as_what_changed(remote, tiny_model_dir):
    """Pushes in bf16 (model.dtype) at an RL learning rate, `sync.delta: on`: the first version goes
    whole, each later one as the elements whose bf16 bits changed since the server's last version, which
    the server completes from its own copy of that version and checks against the learner's checksum.
    The files it reloads are the learner's byte for byte, and it serves the run's last weights."""
    url, store, uploads, steps = remote.url, remote.store, remote.uploads, 4
    out = train(store, "far-delta", url, f"model.path={tiny_model_dir}", "model.dtype=bfloat16",
                "learner.lr=1e-6", f"run.steps={steps}", "sync.delta=on")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    _, rows = query(store, """SELECT "sync/version", "sync/delta_servers", "sync/upload_bytes" FROM steps
        WHERE run_id = 'far-delta' AND "sync/version" IS NOT NULL ORDER BY step""")  # fmt: skip
    kept = sorted(p.name for p in (store / "weights" / "far-delta").glob("v*"))
    whole = size(store / "weights" / "far-delta" / kept[-1])
    assert [r[0] for r in rows] == list(range(1, steps + 1)) and all(r[1] == 1 for r in rows), rows
    # v0, the first, went whole; AdamW's first steps move every weight by the whole learning rate (13%
    # of the bytes here, measured), later ones fewer bf16 values
    assert all(0 < r[2] < 0.2 * whole for r in rows) and rows[-1][2] < 0.1 * whole, (whole, rows)
    for v in kept:
        mine = store / "weights" / "far-delta" / v / "model.safetensors"
        assert (uploads / "far-delta" / v / "model.safetensors").read_bytes() == mine.read_bytes(), v
    assert gap(load(store / "weights" / "far-delta" / kept[-1]), served(url)) < 1e-3


def test_a_transport_the_server_cannot_take_fails_before_the_first_step_in_one_line(remote, tiny_model_dir):
    out = train(remote.store, "far-wrong", remote.url, f"model.path={tiny_model_dir}", "sync.transport=path")
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert f"sync.transport is 'path' but the vLLM server at {remote.url} cannot read" in line
    assert not (remote.store / "steps" / "run_id=far-wrong").exists()  # no step ran


def test_a_learner_killed_mid_upload_leaves_the_last_whole_version_served(remote, tiny_model_dir):
    from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
    from grpoflow.tasks.push.push import load_version, weight_push

    url, store, uploads = remote.url, remote.store, remote.uploads
    # The base weights, sent as promotion and revival send a version: over the network (forced: the
    # model dir is not hidden from the server, so `auto` would send its path).
    base = weight_push(store, "far-base", SyncConfig(transport="network"), InferenceConfig(api_key=KEY))
    load_version(base, url, tiny_model_dir, 0)
    assert (uploads / "far-base" / "v000000" / "config.json").is_file()
    # SIGKILL the learner after the second chunk of its first push reached the server.
    out = train(
        store,
        "far-kill",
        url,
        f"model.path={tiny_model_dir}",
        env_extra={"GRPOFLOW_FAULTS": "upload_chunk@2:kill"},
    )
    assert out.returncode == -9, out.stderr[-3000:]
    assert list(uploads.glob(".incoming-*")), "the kill did not land mid-upload"
    assert not (uploads / "far-kill").exists()  # nothing half-sent is published
    assert asyncio.run(_on(url, lambda c: c.is_paused())) is False  # an upload never pauses it
    assert gap(load(tiny_model_dir), served(url)) < 1e-3  # the last whole version, as before the kill
    out = train(store, "far-kill", url, f"model.path={tiny_model_dir}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    kept = sorted(p.name for p in (store / "weights" / "far-kill").glob("v*"))
    assert sorted(p.name for p in (uploads / "far-kill").iterdir()) == kept
    assert not list(uploads.glob(".incoming-*"))  # the dead upload's staging dir was swept
    assert gap(load(store / "weights" / "far-kill" / kept[-1]), served(url)) < 1e-3


def test_a_learner_killed_mid_delta_leaves_the_version_before_it_served(remote, tiny_model_dir):
    """A bf16 run's first delta (v1, from the whole v0 its first load sent) is cut off by SIGKILL after
    its first chunk: the server publishes nothing of it and serves v0; the resumed run sends its first
    version whole (a new learner knows no base on the server) and deltas after it, and every version on
    the server's disk is the learner's byte for byte."""
    url, store, uploads = remote.url, remote.store, remote.uploads
    sets = (f"model.path={tiny_model_dir}", "model.dtype=bfloat16", "learner.lr=1e-6", "sync.delta=on")
    out = train(store, "far-dkill", url, *sets, env_extra={"GRPOFLOW_FAULTS": "delta_chunk@1:kill"})
    assert out.returncode == -9, out.stderr[-3000:]
    assert list(uploads.glob(".incoming-*")), "the kill did not land mid-upload"
    mine = store / "weights" / "far-dkill"
    assert sorted(p.name for p in (uploads / "far-dkill").iterdir()) == ["v000000"]  # v1 never published
    assert (mine / "v000001").is_dir()  # the learner had made it
    assert asyncio.run(_on(url, lambda c: c.is_paused())) is False
    assert gap(load(mine / "v000000"), served(url)) < 1e-3
    out = train(store, "far-dkill", url, *sets, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    _, rows = query(store, """SELECT "sync/version", "sync/delta_servers" FROM steps
        WHERE run_id = 'far-dkill' AND "sync/version" IS NOT NULL ORDER BY step""")  # fmt: skip
    assert len(rows) == STEPS and rows[-1][1] == 1, rows  # the last push went as a delta
    kept = sorted(p.name for p in mine.glob("v*"))
    assert sorted(p.name for p in (uploads / "far-dkill").iterdir()) == kept
    for v in kept:
        assert (uploads / "far-dkill" / v / "model.safetensors").read_bytes() == (
            mine / v / "model.safetensors"
        ).read_bytes(), v
    assert not list(uploads.glob(".incoming-*"))  # the dead upload's staging dir was swept
    assert gap(load(mine / kept[-1]), served(url)) < 1e-3


KILL_AFTER_STEP, DEATH_STEPS = 1, 6  # the host-death run's (the tests above train STEPS)
# The watcher's progress (host_dead: killed, link down; host_back: its server rejoined) and the run's
# (last_generated: its last batch was generated), each set once.
host_dead, last_generated, host_back, run_over = (threading.Event() for _ in range(4))
rejoined: list[tuple[int, int]] = []  # (replica index, version it serves) each time one rejoins


def gated_letter(completions, trainer_state, **kw):
    """letter_fraction, scored where the test holds the run (the flow's loop submits batch s + 1 before
    it trains step s; max_staleness 1):
    - step KILL_AFTER_STEP + 2's batch waits until the second host is dead, so the push after it, and the
      batches submitted after that push (the last one), come after the kill;
    - the last batch, once generated (its servers' health taken), lets the host start again and waits
      until its server has rejoined: the last push then reaches both servers.
    Nothing here depends on how long a kill, a start or a step takes."""
    from grpoflow.examples.rewards import letter_fraction

    step = trainer_state.global_step
    if step >= KILL_AFTER_STEP + 2 and not host_dead.wait(300):
        raise TimeoutError("the second host was not killed within 5 min")
    if step == DEATH_STEPS - 1:
        last_generated.set()
        if not host_back.wait(300):
            raise TimeoutError("the second host's server did not rejoin within 5 min")
    return letter_fraction(completions, trainer_state=trainer_state, **kw)


def test_a_server_host_that_dies_mid_run_rejoins_at_the_served_version(
    remote, tiny_model_dir, vllm_server, prefect_api, monkeypatch
):
    """Two servers: the session's own on this host (path) and the second host's (network). The second
    host dies whole (every process, its link down) after step KILL_AFTER_STEP: its groups are generated
    on the local server and the run goes on; the host comes back, its server starts, and the run's
    reviver sends it the served version over the network before it rejoins. The run pushes bf16 at an
    RL learning rate, so what reaches the second host goes as deltas, after its restart as before."""
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.tasks.rollouts.replicas import ReplicaSet

    store, steps = remote.store, DEATH_STEPS
    sets = [f"storage.root={store}", f"model.path={tiny_model_dir}", f"run.steps={steps}", "run.run_id=far-death",
            f"inference.urls=[{vllm_server.url}, {remote.url}]", f"inference.api_key={KEY}", "inference.retries=1",
            "model.dtype=bfloat16", "learner.lr=1e-6", "sync.delta=on",
            "run.checkpoint_every=100", "rewards=[{name: letter, fn: 'tests.integration.test_hosts_push:gated_letter', "
            "kwargs: {target_letter: a}, timeout_s: 600}]"]  # fmt: skip
    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", sets)
    rejoin = ReplicaSet._rejoin

    def noting_rejoin(self, rep):
        back = rejoin(self, rep)
        if back:
            rejoined.append((rep.index, rep.versions.get()))
        return back

    monkeypatch.setattr(ReplicaSet, "_rejoin", noting_rejoin)
    errors: list[BaseException] = []

    def kill_then_revive() -> None:
        try:
            marker = store / "steps" / "run_id=far-death" / f"step-{KILL_AFTER_STEP:06d}.parquet"
            wait_for(marker.exists, 600, f"the run to store step {KILL_AFTER_STEP}")
            remote.host.kill()
            host_dead.set()
            wait_for(last_generated.is_set, 600, "the last batch to be generated without the host")
            if run_over.is_set():  # it failed before its last batch: nothing waits for the host
                return
            remote.host.revive()  # the machine boots again: no process of before runs there
            remote.start(tiny_model_dir)
            wait_for(lambda: any(i == 1 for i, _ in rejoined), 300, "the revived server to rejoin")
        except BaseException as e:
            errors.append(e)
        finally:  # the run waits on none of these once the watcher is gone
            host_dead.set()
            host_back.set()

    watcher = threading.Thread(target=kill_then_revive, daemon=True)
    watcher.start()
    try:
        summary = grpo_train(config=cfg)
    finally:
        run_over.set()
        last_generated.set()  # a run that failed early: the watcher stops waiting for it
        watcher.join(600)
    assert not errors, errors
    assert summary["steps_trained"] == steps and summary["transports"] == {
        vllm_server.url: "path", remote.url: "network"}  # fmt: skip
    _, counts = query(
        store, "SELECT step, count(*) FROM rollouts WHERE run_id = 'far-death' GROUP BY step ORDER BY step"
    )
    assert counts == [(s, 64) for s in range(steps)]  # every step once, whole
    _, rows = query(store, """SELECT step, "gen/server1/up", "sync/servers", "sync/network_servers",
        "sync/delta_servers" FROM steps WHERE run_id = 'far-death' ORDER BY step""")  # fmt: skip
    down = [r[0] for r in rows if r[1] == 0.0]
    assert down and min(down) > KILL_AFTER_STEP, rows  # batches generated without it, after the kill
    # (servers, over the network) of each push: both before the kill, its own over the network (a push
    # while it was down, if the run made one then, went to the local server alone); both at the last.
    pushes = [(r[2], r[3]) for r in rows]
    assert set(pushes[: KILL_AFTER_STEP + 1]) == {(2.0, 1.0)} and pushes[-1] == (2.0, 1.0), rows
    assert set(pushes) <= {(2.0, 1.0), (1.0, 0.0)}, rows
    # bf16 pushes at an RL learning rate: each push to the second host goes as a delta on top of the
    # version its disk holds (the first load sent v0 whole), the last one too, after its restart.
    assert all(r[4] == r[3] for r in rows), rows
    # It rejoined (at the version served then: the reviver's load), holds what the learner keeps, and
    # serves the run's last weights, all received over the network.
    assert [i for i, _ in rejoined] == [1]
    kept = sorted(p.name for p in (store / "weights" / "far-death").glob("v*"))
    assert sorted(p.name for p in (remote.uploads / "far-death").iterdir()) == kept
    assert gap(load(store / "weights" / "far-death" / kept[-1]), served(remote.url)) < 1e-3
