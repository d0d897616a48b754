"""Environments for the unit tests, importable by path (config checks resolve 'module:Class')."""

from __future__ import annotations

import threading


class TargetEnv:
    """Each reset draws the next target from a class-wide counter, so the samples of one group get
    different reset notes (as a random target or a fresh board would)."""

    draws = 0

    def reset(self, **row) -> str:
        TargetEnv.draws += 1
        self.target = TargetEnv.draws
        return f"Your target is {self.target}."

    def get_reward(self) -> float:
        return float(self.target)


class ListEnv:
    """Mutable state shared by reference (a list), a tool that adds to it, and a tool that hangs until
    `release` is set and then writes to the state it was bound to (and sets `wrote`)."""

    release = threading.Event()
    wrote = threading.Event()  # a test waits on this, not on a sleep, for the late write to happen

    def __init__(self) -> None:
        self.items: list[str] = []

    def reset(self, **row) -> str:
        self.items.clear()  # in place: a shallow snapshot would see this
        return ""

    def put(self, item: str) -> str:
        """Add an item.

        Args:
            item: the item
        """
        self.items.append(item)
        return "ok"

    def hang(self) -> str:
        """Never returns in time."""
        ListEnv.release.wait(30)
        self.items.append("late")
        ListEnv.wrote.set()
        return "too late"


class LockedEnv:
    """Holds a lock: cannot be deep-copied, and defines no snapshot()."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def reset(self, **row) -> str:
        return ""


class LockedEnvWithSnapshot(LockedEnv):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def snapshot(self) -> dict:
        return {"count": self.count}


class EchoEnv:
    """TRL's contract, a second environment for the dict form: an `echo` tool, get_reward() = echoes."""

    def reset(self, **row) -> None:  # TRL allows None: nothing added to the prompt
        self.said: list[str] = []

    def echo(self, text: str) -> str:
        """Say something back.

        Args:
            text: what to say
        """
        self.said.append(text)
        return text

    def get_reward(self) -> float:
        return float(len(self.said))


class MoodyEnv:
    """get_reward() answers in turn: a number, None, a string, NaN, an exception, a bool (each rollout
    gets the next), so one batch holds every outcome a cell can have."""

    OUTCOMES = (2.5, None, "high", float("nan"), RuntimeError("no score today"), True)
    calls = 0

    def reset(self, **row) -> str:
        return ""

    def get_reward(self):
        out = MoodyEnv.OUTCOMES[MoodyEnv.calls % len(MoodyEnv.OUTCOMES)]
        MoodyEnv.calls += 1
        if isinstance(out, Exception):
            raise out
        return out


class SlowRewardEnv:
    """get_reward() hangs past the tool timeout (until `release`), then writes to its instance."""

    release = threading.Event()
    made = 0

    def __init__(self) -> None:
        SlowRewardEnv.made += 1
        self.late = False

    def reset(self, **row) -> str:
        return ""

    def get_reward(self) -> float:
        SlowRewardEnv.release.wait(30)
        self.late = True
        return 1.0


class PuzzleEnv:
    """Owns its data: reset() returns the prompt, the puzzle drawn from the row's `seed` (a group's
    samples share it); `EMPTY` makes it return nothing."""

    EMPTY = False

    def reset(self, seed: int = 0, **row) -> str | None:
        self.answer = seed * 3
        return None if PuzzleEnv.EMPTY else f"Puzzle {seed}: what is {seed} times 3?"

    def get_reward(self) -> float:
        return 1.0
