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
    `release` is set and then writes to the state it was bound to."""

    release = threading.Event()

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
