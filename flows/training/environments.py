"""Environments as a run uses them (TRL's `environment_factory`; tasks/rollouts/multi_turn.py runs
them): checked before anything starts, their `get_reward()` made a reward, their rows checked, and
the rows of an environment that owns its data.

- `check_run`: the whole preflight of a run's config: its import paths, then the checks below.
- `check_environments`: each factory imports, makes an instance, and the instance snapshots in
  isolation (its own snapshot(), or a deep copy).
- `environment_rewards`: with `tools.environment_reward`, each environment class that has `get_reward()`
  adds a reward entry named after it, weight 1 (tasks/rewards/env_reward.py); in the dict form a
  rollout of another class has no value in it (TRL 1.16's rule). Without `rewards` in the config they
  replace the default one.
- `check_environment_rows`: in the dict form every row names one of the environments.
- `check_mcp`: `tools.mcp` servers allowed, reachable, and their tool names unique.
- `check_verifiers` (`tools.verifiers`): the extra installed, the environment loads, nothing else
  claims the rows or the tools; its rewards become reward entries (tasks/rewards/vf_reward.py), and
  `verifiers_rows` are its taskset's tasks.
- `environment_rows`: no dataset (`data.generator: null`): `run.steps x data.prompts_per_step` rows
  whose prompt is what `reset(**row)` returns; each carries `seed`, the same for a group's samples, so
  an environment that draws its task from it gives the group one task.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from grpoflow.flows.config import ConfigError, GRPOConfig, check_imports, resolve_import
from grpoflow.flows.processes.launch import is_healthy
from grpoflow.tasks.config.allowlist import NotAllowedError, check_import_path, check_server, enforced
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.rollouts import McpServerConfig, is_server_url
from grpoflow.tasks.rewards.env_reward import ENVIRONMENT_REWARD, has_reward
from grpoflow.tasks.rollouts.openenv import OpenEnvServer
from grpoflow.tasks.rollouts.tools import environment_tools
from grpoflow.tasks.threads import run_blocking


def check_run(cfg: GRPOConfig) -> None:
    """A run's config checked before anything starts (train, evaluate, retrain, and the CLI before a
    flow run is created): every import path (`check_imports`), then the environments, MCP servers and
    verifiers environment it names; an environment's get_reward() and a verifiers environment's rewards
    become reward entries here. Idempotent: the CLI and the flow both run it."""
    check_imports(cfg)
    if cfg.tools.environment is not None:
        check_environments(cfg)
        environment_rewards(cfg)  # an environment's get_reward(): a reward entry of its own
    if cfg.tools.mcp:
        check_mcp(cfg)
    if cfg.tools.verifiers is not None:
        check_verifiers(cfg)  # its rewards: reward entries of their own


def _field(name: str | None) -> str:
    return "tools.environment" if name is None else f"tools.environment.{name}"


def environment_factories(cfg: GRPOConfig) -> dict[str | None, Any]:
    """The factories, resolved, by the name a row's `environment` column gives (None: the one): an
    OpenEnv server's URL is a factory of sessions with it (tasks/rollouts/openenv.py)."""
    out = {}
    for name, f in cfg.tools.environments().items():
        if is_server_url(f):
            out[name] = OpenEnvServer(f)
        else:
            out[name] = resolve_import(f, _field(name)) if isinstance(f, str) else f
    return out


def _check_server(server: OpenEnvServer, field: str) -> None:
    """A worker-started run may use it (GRPOFLOW_ALLOWED_SERVERS), and it answers its health check."""
    try:
        check_server(server.url, field)
    except NotAllowedError as e:
        raise ConfigError(str(e)) from None
    if not is_healthy(server.url, timeout_s=10.0):
        raise ConfigError(
            f"{field}: the OpenEnv server at {server.url} does not answer ({server.url}/health)"
        )


def check_environments(cfg: GRPOConfig) -> None:
    """Every environment can be made and snapshots in isolation: a shallow copy would share state with
    the pooled instance that the next rollout resets. An environment server is allowed and answers."""
    for name, factory in environment_factories(cfg).items():
        if isinstance(factory, OpenEnvServer):
            _check_server(factory, _field(name))
            continue
        path = cfg.tools.environments()[name]
        path = path if isinstance(path, str) else getattr(factory, "__qualname__", "environment")
        try:
            env = factory()
        except Exception as e:
            raise ConfigError(f"{_field(name)}: {path}() failed: {type(e).__name__}: {e}") from e
        if callable(getattr(env, "snapshot", None)):
            continue
        try:
            copy.deepcopy(env)
        except Exception as e:
            raise ConfigError(
                f"{_field(name)}: {path} instances cannot be deep-copied ({type(e).__name__}: {e}); "
                "define a snapshot() method that returns an isolated copy of the state your reward "
                "functions read"
            ) from e


def environment_rewards(cfg: GRPOConfig) -> None:
    """Add the reward entries of the environments' get_reward() (the module doc); idempotent. TRL's rule:
    one per environment class that has get_reward(), named after the class, weight 1; in the dict form,
    a rollout of another environment has no value in that column (tasks/rewards/score.py)."""
    factories = environment_factories(cfg) if cfg.tools.environment_reward else {}
    with_reward = {n: f for n, f in factories.items() if has_reward(f)}
    if any(r.fn == ENVIRONMENT_REWARD for r in cfg.rewards):
        return
    if not with_reward:
        if "rewards" not in cfg.model_fields_set and cfg.tools.environment is not None:
            why = (
                "has no get_reward()"
                if cfg.tools.environment_reward
                else "is not scored (environment_reward: false)"
            )
            raise ConfigError(
                f"rewards: the config names no reward, and tools.environment {why}: name the rewards to "
                "train for (the demo's letter reward is no environment's)"
            )
        return
    classes: dict[str, list] = {}  # reward name -> the environments (dict keys) whose class it is
    for env, f in with_reward.items():
        name = getattr(f, "reward_name", None) or getattr(f, "__name__", type(f).__name__)
        classes.setdefault(name, []).append(env)
    clash = sorted(set(classes) & {r.name for r in cfg.rewards})
    if clash:
        raise ConfigError(
            f"rewards: {clash[0]!r} is the name of tools.environment's get_reward() reward; rename yours, or "
            "set tools.environment_reward: false"
        )
    if len(classes) == 1 and len(with_reward) == len(factories):  # every rollout's environment has it
        specs = [RewardConfig(name=name, fn=ENVIRONMENT_REWARD) for name in classes]
    else:
        specs = [
            RewardConfig(name=n, fn=ENVIRONMENT_REWARD, kwargs={"environments": envs})
            for n, envs in classes.items()
        ]
    # TRL's rule: the environment's reward and the reward functions both count; the default reward
    # (the demo's) only stands in when no reward is configured.
    cfg.rewards = [*cfg.rewards, *specs] if "rewards" in cfg.model_fields_set else specs


def check_environment_rows(cfg: GRPOConfig, rows: list[dict[str, Any]], where: str = "data") -> None:
    """The dict form: every row's `environment` column names one of the environments."""
    names = cfg.tools.environments()
    if not names or None in names:
        return
    for i, row in enumerate(rows):
        if row.get("environment") not in names:
            got = f"environment {row['environment']!r}" if "environment" in row else "no 'environment' field"
            raise ConfigError(
                f"{where}: row {i} has {got}; tools.environment names {sorted(names)}, and each row's "
                "`environment` column picks the one its rollouts use"
            )


def owns_its_data(cfg: GRPOConfig) -> bool:
    """No dataset: the environment's reset() gives the prompts."""
    d = cfg.data
    return not d.path and d.dataset is None and not d.generator and cfg.tools.environment is not None


def environment_rows(cfg: GRPOConfig) -> list[dict[str, Any]]:
    """The rows of an environment that owns its data (the module doc): an empty user turn that reset()'s
    text fills (a rollout whose reset() returns nothing fails, tasks/rollouts/multi_turn.py)."""
    n = cfg.run.steps * cfg.data.prompts_per_step
    return [{"prompt": [{"role": "user", "content": ""}], "id": f"env-{i}", "seed": i} for i in range(n)]


def check_mcp(cfg: GRPOConfig) -> None:
    """`tools.mcp`: each server allowed (a worker-started run: its URL in GRPOFLOW_ALLOWED_SERVERS, a stdio
    command `python -m <allowed module>`), reachable, and no tool name given twice (by two servers, or
    by a server and a function or an environment's method)."""
    if not cfg.tools.mcp:
        return
    from grpoflow.tasks.rollouts.mcp_tools import McpMissingError, describe, tool_names

    names: dict[str, str] = {}
    for i, t in enumerate(cfg.tools.tools):
        names[t.rsplit(":", 1)[-1] if isinstance(t, str) else t.__name__] = f"tools.tools[{i}]"
    for name, factory in environment_factories(cfg).items():
        if not isinstance(factory, OpenEnvServer):  # a server's tools are its sessions'
            for method in environment_tools(factory()):
                names.setdefault(method, f"{_field(name)} (a method)")
    for i, server in enumerate(cfg.tools.mcp):
        field = f"tools.mcp[{i}] ({server.name})"
        _confine_mcp(server, field)
        try:
            listed = run_blocking(tool_names(server))
        except McpMissingError as e:
            raise ConfigError(f"{field}: {e}") from None
        except Exception as e:  # unreachable, refused, not an MCP server: one line, naming it
            raise ConfigError(f"{field}: cannot list the tools of {describe(server)}: {_reason(e)}") from None
        for tool in listed:
            if tool in names:
                raise ConfigError(
                    f"{field}: its tool {tool!r} has the name of {names[tool]}'s; tool names must differ"
                )
            names[tool] = field


def _reason(e: BaseException) -> str:
    """The innermost cause of an error (anyio groups wrap a connection's failure)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


def _confine_mcp(server: McpServerConfig, field: str) -> None:
    try:
        if server.url is not None:
            check_server(server.url, field)
        elif enforced():
            cmd = server.command or []
            if len(cmd) < 3 or Path(cmd[0]).name not in ("python", "python3") or cmd[1] != "-m":
                raise NotAllowedError(
                    f"{field}: a worker-started run starts a stdio MCP server only as "
                    f"`python -m <module>`, not {cmd}"
                )
            check_import_path(f"{cmd[2]}:main")
    except NotAllowedError as e:
        raise ConfigError(str(e)) from None


VERIFIERS_MAX_TURNS = 10  # generation.max_turns of a verifiers run that sets none: its episodes end them


def check_verifiers(cfg: GRPOConfig) -> None:
    """`tools.verifiers` (the module doc): one `error:` line naming the field when it cannot run; then
    its rewards join `rewards` (idempotent: preflight runs twice for a CLI run)."""
    from grpoflow.tasks.rewards.vf_reward import VERIFIERS_REWARD
    from grpoflow.tasks.rollouts import verifiers_env

    block, t, d = cfg.tools.verifiers, cfg.tools, cfg.data
    others = [
        f
        for f, on in (("tools.tools", t.tools), ("tools.environment", t.environment), ("tools.mcp", t.mcp))
        if on
    ]
    if others:
        raise ConfigError(
            f"tools.verifiers: its environment brings its own tools; remove {', '.join(others)}"
        )
    if d.path or d.dataset is not None or ("generator" in d.model_fields_set and d.generator):
        raise ConfigError(
            "tools.verifiers: the rows come from its taskset; remove data.path / dataset / generator"
        )
    taskset = block["taskset"].get("id") if isinstance(block.get("taskset"), dict) else None
    if not taskset:
        raise ConfigError(
            "tools.verifiers.taskset.id: name the taskset (its package or module, as `vf eval` takes it)"
        )
    try:
        check_import_path(f"{taskset.replace('-', '_').rsplit('/', 1)[-1]}:taskset")
        specs = verifiers_env.reward_specs(block)
    except verifiers_env.VerifiersMissingError as e:
        raise ConfigError(str(e)) from None
    except NotAllowedError as e:
        raise ConfigError(f"tools.verifiers.taskset.id: {e}") from None
    except ValidationError as e:  # a field verifiers' config does not have, or a bad value
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"tools.verifiers.{field}: {first['msg']}") from None
    except Exception as e:  # the package missing, its load() failing: one line, naming it
        raise ConfigError(f"tools.verifiers: cannot load the environment: {_reason(e)}") from None
    if "max_turns" not in cfg.generation.model_fields_set:
        cfg.generation.max_turns = VERIFIERS_MAX_TURNS
    if any(r.fn == VERIFIERS_REWARD for r in cfg.rewards):
        return
    if not specs:
        raise ConfigError(f"tools.verifiers: taskset {taskset!r} records no reward (no @vf.reward, no judge)")
    clash = sorted({n for n, _ in specs} & {r.name for r in cfg.rewards if "rewards" in cfg.model_fields_set})
    if clash:
        raise ConfigError(f"rewards: {clash} are names of the verifiers environment's rewards; rename yours")
    mine = [RewardConfig(name=n, fn=VERIFIERS_REWARD, weight=w) for n, w in specs]
    cfg.rewards = [*cfg.rewards, *mine] if "rewards" in cfg.model_fields_set else mine


def verifiers_rows(cfg: GRPOConfig) -> list[dict[str, Any]]:
    """The verifiers taskset's tasks as rows (all of a bounded one; `run.steps x data.prompts_per_step`
    of an infinite one)."""
    from grpoflow.tasks.rollouts.verifiers_env import task_rows

    rows = task_rows(cfg.tools.verifiers, cfg.run.steps * cfg.data.prompts_per_step)
    if not rows:
        raise ConfigError("tools.verifiers: the taskset has no task")
    return rows
