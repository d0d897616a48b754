"""verifiers environments (`tools.verifiers`; verifiers 0.4, its `verifiers.v1` stack) run as verifiers runs
them, with every model turn on grpoflow's servers.

verifiers runs an episode as a program (its harness, e.g. the `null` chat loop) in a runtime (a
subprocess here), whose model requests go to verifiers' interception server; that server asks a
`vf.Client` for each response. A trainer's client (verifiers' own `TrainClient`, prime-rl's) renders the
prompt to token ids and asks its engine for tokens and logprobs. `PolicyClient` (verifiers_client.py) is
grpoflow's: it renders with the run's chat template and tool-call format, generates through the rollout's server
(`complete_served`: the served version's model name and cache salt, retries, the pause during a push),
and keeps one token sequence per episode as grpoflow's own multi-turn rollouts do: the model's tokens as
sampled (mask 1), then the tool results, user turns and template glue (`glue_ids`, mask 0). After the
episode, verifiers has scored it (its task's `@vf.reward`s and judges): the rewards, metrics and errors
become the rollout's `VerifiersOutcome`, scored as cells (tasks/rewards/vf_reward.py).

What grpoflow uses of verifiers, and what breaks when it moves (docs/environments.md):
`load_environment` / `resolve_env_config`, `Env.serving` and `Env.run_slot`, `Task.hooks('reward')`,
`vf.Client`, `ModelContext`, `TrainClientConfig`, the `Response`/`TurnTokens` types and
`serialize_completion`, and two internals: the interception server's `clients` map (keyed by the client
config's JSON), where each rollout's client is placed, since verifiers builds clients from configs only;
and the subprocess runtime's class-level setup locks, made per event loop (`_LocksPerLoop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
import weakref
from typing import Any

from grpoflow.storage.records import RolloutCompletion
from grpoflow.tasks.config.imports import extend_sys_path
from grpoflow.tasks.rewards.vf_reward import VerifiersOutcome, outcome_of
from grpoflow.tasks.rollouts.rollout_settings import RolloutSettings
from grpoflow.tasks.rollouts.templates import render
from grpoflow.tasks.rollouts.verifiers_client import PolicyClient, Session, wire_messages

SUPPORTED = ("0.4.",)  # the verifiers releases this adapter was written against and tested with
EXTRA = "pip install 'grpoflow[verifiers]'"
EPISODE_TIMEOUT_S = 600.0  # verifiers' `timeout.episode` where the block sets none (verifiers: no limit)


class VerifiersMissingError(ImportError):
    """verifiers is not installed, or is a release this adapter does not know."""


def require() -> Any:
    """`verifiers.v1`, or a clear error naming the extra."""
    try:
        import verifiers
        import verifiers.v1 as vf
    except ImportError as e:
        raise VerifiersMissingError(f"tools.verifiers needs verifiers 0.4 ({EXTRA}): {e}") from None
    if not verifiers.__version__.startswith(SUPPORTED):
        raise VerifiersMissingError(
            f"tools.verifiers: verifiers {verifiers.__version__} is installed; grpoflow runs verifiers "
            f"{', '.join(v + 'x' for v in SUPPORTED)} ({EXTRA})"
        )
    return vf


def env_config(block: dict[str, Any]) -> Any:
    """The verifiers `[env]` config of `tools.verifiers`, with grpoflow's defaults where the block sets
    none: one interception server (grpoflow answers its model turns), every seat's harness program in a
    local subprocess, and the tool-less `null` chat loop for a taskset that ships no harness (verifiers'
    own default, `bash`, runs the model's shell commands on this host); and an episode deadline
    (`timeout.episode`, EPISODE_TIMEOUT_S; verifiers has none)."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import SubprocessConfig
    from verifiers.v1.utils.loaders import default_harness_id, harness_config_type, resolve_env_config

    extend_sys_path()  # an environment package beside the config
    block = dict(block)
    interception = block.setdefault("interception", {"type": "server"})
    if not isinstance(interception, dict) or interception.get("type", "server") != "server":
        raise ValueError(
            "tools.verifiers.interception: grpoflow answers every model turn through one interception server; "
            "leave it out (or type: server)"
        )
    cfg = resolve_env_config(block)
    if cfg.timeout.episode is None:  # a hung harness or tool fails its episode, never the batch
        cfg.timeout.episode = EPISODE_TIMEOUT_S
    default = default_harness_id(cfg.taskset.id)
    for spec in agent_config_fields(cfg).values():
        if "runtime" not in spec.model_fields_set:
            spec.runtime = SubprocessConfig()
        if spec.harness is None and default == "bash":
            spec.harness = harness_config_type("null").model_validate({"id": "null"})
    return cfg


class _Envs:
    """Loaded environments, one per concurrent batch (an `Env` serves one batch at a time), by block."""

    def __init__(self) -> None:
        self.free: dict[str, list[Any]] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, block: dict[str, Any]):
        require()
        key = json.dumps(block, sort_keys=True, default=str)
        with self.lock:
            pool = self.free.setdefault(key, [])
            env = pool.pop() if pool else None
        if env is None:
            from verifiers.v1.utils.loaders import load_environment

            env = load_environment(env_config(block))
        try:
            yield env
        finally:
            with self.lock:
                self.free[key].append(env)


ENVS = _Envs()


def task_rows(block: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The taskset's tasks as rows: all of a bounded taskset, the first `n` of an infinite one. A row
    carries the task's data (`vf_task`, its JSON), its key as `id`, and its prompt as grpoflow shows it."""
    with ENVS.take(block) as env:
        taskset = env.taskset
        tasks = list(taskset if taskset.bounded else taskset.take(n))
    rows = []
    for task in tasks:
        data = task.data
        prompt = (
            data.prompt if isinstance(data.prompt, str) or data.prompt is None else wire_messages(data.prompt)
        )
        rows.append({"prompt": prompt or "", "id": f"vf-{task.key}", "vf_task": data.model_dump_json()})
    return rows


def reward_specs(block: dict[str, Any]) -> list[tuple[str, float]]:
    """(name, weight) of each reward the taskset's tasks record: their `@vf.reward` methods, plugged
    rewards and judges, as verifiers scores them."""
    with ENVS.take(block) as env:
        task = next(iter(env.taskset.take(1)), None)
    if task is None:
        raise ValueError("tools.verifiers: the taskset has no task")
    out = [(fn.__name__, float(getattr(fn, "_vf_weight", 1.0))) for fn in task.hooks("reward")]
    out += [(j.reward_name, float(j.config.weight)) for j in task.plugged_judges()]
    return out


def _task_of(env: Any, row: dict[str, Any]) -> Any:
    task_cls = type(env.taskset).task_type()
    return task_cls(task_cls.data_type().model_validate_json(row["vf_task"]), env.taskset.config.task)


def _ensure_uv() -> None:
    """verifiers starts harness programs with `uv`: this environment's, when it is not on PATH."""
    here = os.path.dirname(sys.executable)
    if shutil.which("uv") is None and shutil.which("uv", path=here):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def _child_paths() -> None:
    """A user's environment package beside the config reaches verifiers' tool-server processes."""
    from grpoflow.tasks.config.imports import search_dirs

    have = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    add = [d for d in search_dirs() if d not in have]
    if add:
        os.environ["PYTHONPATH"] = os.pathsep.join([p for p in have if p] + add)


class _LocksPerLoop(dict):
    """verifiers' subprocess runtime keeps the locks of its harness programs' setup in one class-level dict
    shared by every event loop of the process, while grpoflow runs each batch on a loop of its own (two at
    once when generation runs ahead): an `asyncio.Lock` bound to one loop fails on another. Here each
    loop gets its own."""

    def __init__(self) -> None:
        super().__init__()
        self.loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def setdefault(self, key, default=None):
        return self.loops.setdefault(asyncio.get_running_loop(), {}).setdefault(key, default)


def _locks_per_loop() -> None:
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    if not isinstance(SubprocessRuntime._locks, _LocksPerLoop):  # the second internal (module doc)
        SubprocessRuntime._locks = _LocksPerLoop()


# Runs beside this process: once it is gone (a kill -9 runs no cleanup), every process that carries its
# mark goes too. verifiers starts harness programs and tool servers in sessions of their own, which
# outlive their parent; they inherit this process's environment, and so the mark.
_WATCHDOG = """
import os, sys, time
os.setsid()
parent, mark = int(sys.argv[1]), sys.argv[2].encode()
def alive(pid):  # a zombie (killed, not yet reaped) is dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while alive(parent):
    time.sleep(0.5)
for pid in [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            marked = mark in f.read().split(b"\\0")
    except OSError:
        continue
    if marked:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, 9)
            except OSError:
                pass
"""
MARK = "GRPOFLOW_VF_OWNER"
_watching = threading.Lock()


def _watch_children() -> None:
    """Start the watchdog once per process (the comment above)."""
    with _watching:
        if os.environ.get(MARK) == str(os.getpid()):
            return
        os.environ[MARK] = str(os.getpid())
        # Started through a shell that exits at once, so it is no child of ours (it leaves no zombie, and
        # no test counts it among this process's children).
        subprocess.run(
            [
                "sh",
                "-c",
                '"$0" -c "$1" "$2" "$3" </dev/null >/dev/null 2>&1 &',
                sys.executable,
                _WATCHDOG,
                str(os.getpid()),
                f"{MARK}={os.getpid()}",
            ],
            check=True,
            start_new_session=True,
        )


@contextlib.asynccontextmanager
async def serving(block: dict[str, Any]):
    """One batch's environment, serving (its shared tool servers and interception server up)."""
    _ensure_uv()
    _child_paths()
    _locks_per_loop()
    _watch_children()
    with ENVS.take(block) as env:
        async with env.serving():
            yield env


_CLIENT_CLASS: type | None = None


def _client(r: RolloutSettings, index: int, sample: int) -> PolicyClient:
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        vf = require()
        _CLIENT_CLASS = type("PolicyClient", (PolicyClient, vf.Client), {"__module__": __name__})
    return _CLIENT_CLASS(r, index, sample)


async def verifiers_rollout(r: RolloutSettings, env: Any, row: dict[str, Any], index: int, sample: int):
    """One episode of the row's task as a rollout: verifiers runs it (harness, tools, its scoring) with
    this rollout's `PolicyClient`; the policy's turns become the completion, verifiers' verdict its
    `VerifiersOutcome`."""
    from verifiers.v1.env import RunSlot
    from verifiers.v1.interception.server import InterceptionServer

    vf = require()
    client = _client(r, index, sample)
    # A config of its own (an unused header makes its key unique): the interception server hands this
    # rollout's turns to this client; the address is never called (the client generates itself).
    config = vf.TrainClientConfig(
        base_url="http://127.0.0.1:9/v1",
        api_key_var="GRPOFLOW_UNUSED",
        headers={"X-Grpoflow-Rollout": uuid.uuid4().hex},
    )
    server = env._interception
    if not isinstance(server, InterceptionServer):
        raise TypeError(
            f"tools.verifiers: expected verifiers' InterceptionServer, got {type(server).__name__}"
        )
    key = config.model_dump_json()
    server.clients[key] = client
    t0, v0 = time.perf_counter(), r.version_fn()
    try:
        episode = await env.run_slot(
            RunSlot(_task_of(env, row)), vf.ModelContext(model="policy", client=config)
        )
    finally:
        server.clients.pop(key, None)
    if client.unavailable is not None:
        raise client.unavailable
    return _completion(r, client, episode, sample, row, v0, time.perf_counter() - t0)


def _completion(r, client: PolicyClient, episode: Any, sample: int, row: dict, v0: int, seconds: float):
    outcome: VerifiersOutcome = outcome_of(episode)
    ids = {t.id for t in episode.traces}
    used = [s for sid, s in client.sessions.items() if sid in ids and s.turns]
    if len(used) > 1 and outcome.error is None:
        outcome.error = (
            f"{len(used)} seats of the episode called the policy; grpoflow trains one sequence per rollout"
        )
    s = used[0] if used else Session()
    if not used:  # the harness never asked: nothing to train; its cells say why (outcome.error)
        s.prompt_text = (
            row["prompt"] if isinstance(row["prompt"], str) else render(r.tok, row["prompt"], None, True)
        )
        s.ids = r.tok.encode(s.prompt_text, add_special_tokens=False)
        s.prompt_len, s.truncation = len(s.ids), "no_model_turn"
        outcome.error = outcome.error or "the episode made no model turn"
    c = RolloutCompletion(
        sample_index=sample,
        completion="",
        completion_ids=s.ids[s.prompt_len :],
        completion_mask=s.mask,
        logprobs=s.lps,
        messages=s.msgs,
        turns=s.turns,
        tool_calls=s.calls,
        truncated=s.truncation is not None,
        truncation_reason=s.truncation,
        finish_reason=s.finish,
        policy_version=v0 if s.version is None else s.version,
        policy_version_end=r.version_fn(),
        gen_seconds=seconds,
    )
    c.completion = r.text(c.completion_ids)
    c.prompt_ids, c.prompt, c.prompt_input = s.ids[: s.prompt_len], s.prompt_text, row["prompt"]
    c.verifiers = outcome
    return c


async def gather_episodes(r: RolloutSettings, env: Any, row: dict, index: int, bounded) -> list[Any]:
    """The group: G episodes of the row's task, concurrently. An episode that made no model turn shows
    the prompt the group's other episodes were asked (the harness's conversation, templated), so a group
    has one prompt form; with no model turn in the whole group, each shows the row's prompt."""
    comps = list(
        await asyncio.gather(
            *(bounded(verifiers_rollout(r, env, row, index, i)) for i in range(r.gen.group_size))
        )
    )
    asked = next((c for c in comps if c.truncation_reason != "no_model_turn"), None)
    for c in comps:
        if asked is not None and c.truncation_reason == "no_model_turn":
            c.prompt, c.prompt_ids = asked.prompt, list(asked.prompt_ids)
    return comps
