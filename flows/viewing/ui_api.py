"""The rollout explorer's JSON API (flows/viewing/ui.py serves it): each endpoint's query-string parameters
checked, then answered from the store by a `storage/explore*.py` query on a worker thread.

API (query-string parameters; JSON; errors as {"error": message} with 400 or 404):
  /api/runs  /api/run?run=  /api/curves?run=  /api/status_mix?run=&split=
  /api/rollouts?run=&split=&step_min=&step_max=&reward_min=&reward_max=&status=&reward_name=
                &truncated=&tool_failed=&server=&text=&offset=&limit=   (total: null under a text search)
  /api/rollouts_count?(the same filters)
  /api/rollout?run=&split=&step=&group=&sample=   /api/group?run=&split=&step=&group=
  /api/occurrences?row_id=&split=   /api/compare?row_id=&a_run=&a_step=&b_run=&b_step=&split=
  /api/canned   /api/sql?q= | ?canned=&run=  [&format=csv]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpoflow.storage import explore, explore_rollouts
from grpoflow.storage.ids import InvalidRunIdError, validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import CANNED, query

SPLITS = ("train", "eval")


class BadRequest(ValueError):
    """A parameter the page sent is missing or malformed (the message names it)."""


# -- parameters ------------------------------------------------------------------------------------


def _param(
    q, name: str, kind: Callable[[str], Any] = str, default: Any = None, required: bool = False
) -> Any:
    raw = q.get(name, "")
    if raw == "":
        if required:
            raise BadRequest(f"{name}: missing")
        return default
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise BadRequest(f"{name}: {raw!r} is not a valid {getattr(kind, '__name__', 'value')}") from None


def _run(q, name: str = "run") -> str:
    try:
        return validate_run_id(_param(q, name, required=True))
    except InvalidRunIdError as e:
        raise BadRequest(f"{name}: {e}") from None


def _split(q) -> str:
    split = _param(q, "split", default="train")
    if split not in SPLITS:
        raise BadRequest(f"split: {split!r} is not one of {list(SPLITS)}")
    return split


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ValueError(raw)


_flag.__name__ = "flag (1 or 0)"


def rollout_filters(q) -> dict[str, Any]:
    status = _param(q, "status")
    if status is not None and status not in explore.STATUSES:
        raise BadRequest(f"status: {status!r} is not one of {list(explore.STATUSES)}")
    return {
        "split": _split(q),
        "step_min": _param(q, "step_min", int),
        "step_max": _param(q, "step_max", int),
        "reward_min": _param(q, "reward_min", float),
        "reward_max": _param(q, "reward_max", float),
        "status": status,
        "reward_name": _param(q, "reward_name"),
        "truncated": _param(q, "truncated", _flag),
        "tool_failed": _param(q, "tool_failed", _flag, False),
        "server": _param(q, "server"),
        "text": _param(q, "text"),
    }


# -- token texts -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """The run's base model's tokenizer, from local files only; None when it cannot be loaded (the
    page then shows token ids)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # a moved model dir, a missing file: ids still tell the story
        return None


def tokens_of(row: dict, base_model: str | None) -> tuple[list[dict], str | None]:
    """The completion's tokens with their texts (when the base model's tokenizer loads), behaviour
    logprobs and masks."""
    ids = row.pop("completion_ids") or []
    mask = row.pop("completion_mask") or []
    lps = row.pop("logprobs") or []
    tok = _tokenizer(str(Path(base_model).resolve())) if base_model and Path(base_model).is_dir() else None
    texts = [tok.decode([i]) for i in ids] if tok is not None else [None] * len(ids)
    toks = [
        {"id": i, "text": t, "logprob": lp, "mask": m}
        for i, t, lp, m in zip(ids, texts, lps, mask, strict=False)
    ]
    return explore._clean(toks), base_model if tok is not None else None


# -- handlers --------------------------------------------------------------------------------------


class Explorer:
    """The API's handlers over one store root; each runs its queries on a worker thread."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.store = RolloutStore(self.root)

    def _metas(self) -> dict[str, dict]:
        return {r: self.store.read_run_meta(r) or {} for r in self.store.runs()}

    def _meta(self, run_id: str) -> dict:
        meta = self.store.read_run_meta(run_id)
        if meta is None:
            raise explore.NotFound(f"no run {run_id!r} under {self.root}")
        return meta

    def runs(self, q) -> dict:
        metas = self._metas()
        with explore.explorer_connection(self.root) as con:
            return {"runs": explore.runs_overview(con, metas)}

    def run(self, q) -> dict:
        run_id = _run(q)
        meta = self._meta(run_id)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore.run_detail(con, run_id, meta)

    def curves(self, q) -> dict:
        run_id = _run(q)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore.curves(con, run_id)

    def status_mix(self, q) -> dict:
        run_id = _run(q)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore.status_mix(con, run_id, _split(q))

    def rollouts(self, q) -> dict:
        run_id = _run(q)
        filters = rollout_filters(q)
        offset, limit = _param(q, "offset", int, 0), _param(q, "limit", int, 50)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore_rollouts.rollout_page(con, run_id, filters, offset, limit)

    def rollouts_count(self, q) -> dict:
        run_id = _run(q)
        filters = rollout_filters(q)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return {"total": explore_rollouts.rollout_count(con, run_id, filters)}

    def rollout(self, q) -> dict:
        run_id, split = _run(q), _split(q)
        step, group = _param(q, "step", int, required=True), _param(q, "group", required=True)
        sample = _param(q, "sample", int, required=True)
        meta = self.store.read_run_meta(run_id) or {}
        with explore.explorer_connection(self.root, [run_id]) as con:
            row = explore_rollouts.rollout(con, run_id, split, step, group, sample)
        row["tokens"], row["tokenizer"] = tokens_of(row, meta.get("base_model"))
        return row

    def group(self, q) -> dict:
        run_id, split = _run(q), _split(q)
        step, group = _param(q, "step", int, required=True), _param(q, "group", required=True)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore_rollouts.group(con, run_id, split, step, group)

    def occurrences(self, q) -> dict:
        row_id = _param(q, "row_id", required=True)
        with explore.explorer_connection(self.root) as con:
            return {"row_id": row_id, "occurrences": explore_rollouts.occurrences(con, row_id, _split(q))}

    def compare(self, q) -> dict:
        row_id, split = _param(q, "row_id", required=True), _split(q)
        a_run, b_run = _run(q, "a_run"), _run(q, "b_run")
        a_step, b_step = _param(q, "a_step", int, required=True), _param(q, "b_step", int, required=True)
        with explore.explorer_connection(self.root, [a_run, b_run]) as con:
            a = explore_rollouts.group_of_row(con, a_run, a_step, row_id, split)
            b = explore_rollouts.group_of_row(con, b_run, b_step, row_id, split)
        return {"row_id": row_id, "prompt": a["prompt"], "a": a, "b": b}

    def canned(self, q) -> dict:
        return {"queries": {name: " ".join(sql.split()) for name, sql in CANNED.items()}}

    def sql(self, q) -> tuple[list[str], list[tuple]]:
        name = _param(q, "canned")
        if name is not None:
            if name not in CANNED:
                raise BadRequest(f"canned: unknown query {name!r}; choose from {sorted(CANNED)}")
            run = _param(q, "run")
            return query(self.root, CANNED[name], {"run": run})
        return query(self.root, _param(q, "q", required=True))
