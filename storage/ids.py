"""Identifiers the store relies on: run ids (safe single path components) and dataset row ids, with
the eval split a row id decides.

Pure functions of their input: the same row gets the same id, and lands on the same side of the
split, in every run, resume and grown dataset.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidRunIdError(ValueError):
    """A run id that is not a safe single path component (the message names it)."""


def validate_run_id(run_id: str) -> str:
    """Return `run_id` if it is a safe single path component, else raise InvalidRunIdError naming it.

    Run ids become directory names under the store root; anything with a separator, `..`, or a
    leading dot could escape the root or hide a run, so only `[A-Za-z0-9._-]` is allowed.
    """
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or ".." in run_id:
        raise InvalidRunIdError(
            f"invalid run id {run_id!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return run_id


def row_id_of(row: dict[str, Any]) -> str:
    """A dataset row's stable id: its `id` field when it has one (a non-empty string or an integer),
    else a hash of its content (JSON with sorted keys). The same row gets the same id in every run,
    resume and grown dataset, which is what the eval split and the `row_id` column rely on."""
    v = row.get("id")
    if (isinstance(v, str) and v) or (isinstance(v, int) and not isinstance(v, bool)):
        return str(v)
    blob = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:24]


def held_out(row_id: str, fraction: float) -> bool:
    """Whether the row with this id belongs to the eval split of `fraction` of the rows: a pure function
    of the id (a hash), so a row stays on its side however the dataset grows or is reordered."""
    h = int.from_bytes(hashlib.sha256(b"grpoflow-eval\0" + row_id.encode()).digest()[:8], "big")
    return h < fraction * 2**64
