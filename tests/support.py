"""What test modules share, so that none imports another: waiting on a condition, and the data,
configs and projects that several tiers build."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from storage.records import RolloutCompletion, RolloutGroup

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def wait_for(
    condition: Callable[[], T],
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    why: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail naming `what` (and what
    `why` says then, e.g. a log's tail) once `timeout_s` seconds have passed. `condition` may raise
    AssertionError itself to fail early (a process it depends on exited)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            detail = f"\n{why()}" if why is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")
        time.sleep(interval_s)
    return value


def make_groups(n_groups: int = 2, size: int = 3) -> list[RolloutGroup]:
    """Groups whose completion i is "a" * (i + 1): a length reward scores them 1, 2, 3, ..."""
    return [
        RolloutGroup(
            group_id=f"g{g}",
            prompt_index=g,
            prompt=f"<prompt {g}>",
            prompt_ids=[1, 2],
            completions=[
                RolloutCompletion(
                    sample_index=i,
                    completion="a" * (i + 1),
                    completion_ids=[3] * (i + 1),
                    completion_mask=[1] * (i + 1),
                    logprobs=[-1.0] * (i + 1),
                )
                for i in range(size)
            ],
            row={"prompt": f"raw {g}", "answer": g},
        )
        for g in range(n_groups)
    ]


def tiny_cfg(root: Path, model_dir: Path, url: str, **sets: object):
    """configs/tiny-letters.yaml against the server at `url`, storing under `root`, with `sets`."""
    from flows.config import load_config

    overrides = [
        f"storage.root={root}",
        f"model.path={model_dir}",
        f"inference.url={url}",
    ] + [f"{k}={v}" for k, v in sets.items()]
    return load_config(REPO / "configs" / "tiny-letters.yaml", overrides)


def unpause(url: str) -> None:
    """Resume the server at `url`: a run killed mid-push leaves it paused, and later tests need it."""
    from tasks.inference import VLLMClient

    async def go():
        async with VLLMClient(url) as c:
            await c.resume()

    asyncio.run(go())


# A user's project: their reward and tool module, data and config in one folder.
USER_TASK = '''
import json as _json  # the standard library's, not a user file named json.py


def exact(prompts, completions, answer, **_):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return _json.dumps({"key": key})
'''

USER_CONFIG = """
data:
  path: data.jsonl
rewards:
  - {name: exact, fn: "task:exact"}
  - {name: exact_in_a_process, fn: "task:exact", executor: process}
tools:
  tools: ["task:lookup"]
"""


def user_project(tmp_path: Path) -> tuple[Path, Path]:
    """The project folder (with a json.py that would shadow the standard library's if it were put on
    the import path first) and an empty folder to run from."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "task.py").write_text(USER_TASK)
    (proj / "data.jsonl").write_text('{"prompt": "1+1?", "answer": 2}\n{"prompt": "2+2?", "answer": 4}\n')
    (proj / "cfg.yaml").write_text(USER_CONFIG)
    (proj / "json.py").write_text("raise SystemExit('a user file shadowed the standard library')\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return proj, elsewhere
