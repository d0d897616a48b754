"""The Parquet tables' Arrow schemas, and the conversion between typed records and their rows.

`rollout_rows`/`reward_rows` flatten `RolloutGroup`s (storage/records.py) into one row per completion
and one row per (completion, reward function) for the tables described in docs/architecture.md,
section 5; `groups_from_rows` rebuilds the groups from them.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from grpoflow.storage import records

# ---------------------------------------------------------------------------------------------
# Arrow schemas

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string()), ("is_completion", pa.bool_())])
TURN_TYPE = pa.struct(
    [
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("duration_s", pa.float64()),
        ("finish_reason", pa.string()),
    ]
)
TOOL_CALL_TYPE = pa.struct(
    [
        ("turn", pa.int32()),
        ("name", pa.string()),
        ("arguments", pa.string()),
        ("result", pa.string()),
        ("failed", pa.bool_()),
        ("error", pa.string()),
        ("duration_s", pa.float64()),
        ("node", pa.string()),  # absent from files written before it (read by name, as None)
    ]
)

ROLLOUTS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("split", pa.string()),
        ("step", pa.int64()),
        ("policy_version", pa.int64()),
        ("policy_version_end", pa.int64()),
        ("server", pa.string()),
        ("staleness", pa.int64()),
        ("group_id", pa.string()),
        ("sample_index", pa.int32()),
        ("prompt_index", pa.int64()),
        ("row_id", pa.string()),
        ("prompt", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("completion", pa.string()),
        ("completion_ids", pa.list_(pa.int32())),
        ("completion_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("completion_tokens", pa.int32()),
        ("num_turns", pa.int32()),
        ("turns", pa.list_(TURN_TYPE)),
        ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
        ("truncated", pa.bool_()),
        ("truncation_reason", pa.string()),
        ("finish_reason", pa.string()),
        ("reward", pa.float64()),
        ("reward_valid", pa.bool_()),
        ("invalid_reason", pa.string()),
        ("advantage", pa.float64()),
        ("trained", pa.bool_()),
        ("drop_reason", pa.string()),
        ("gen_seconds", pa.float64()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

REWARDS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("split", pa.string()),
        ("step", pa.int64()),
        ("group_id", pa.string()),
        ("sample_index", pa.int32()),
        ("reward_name", pa.string()),
        ("weight", pa.float64()),
        ("value", pa.float64()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("duration_s", pa.float64()),
        ("imputed", pa.bool_()),
        ("imputed_value", pa.float64()),
        ("extra", pa.string()),  # JSON object of the function's log_extra columns for this completion
        ("node", pa.string()),  # where the cell was scored: a Ray node's address, or the host's name
    ]
)

# Steps: these core columns always exist; any further numeric metric of a step becomes its own
# float64 column (readers union files by name), so `SELECT step, loss FROM steps` just works.
STEPS_CORE_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("policy_version", pa.int64()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "rollouts": ROLLOUTS_SCHEMA,
    "rewards": REWARDS_SCHEMA,
    "steps": STEPS_CORE_SCHEMA,
}


def _now() -> datetime:
    return datetime.now(UTC)


def rollout_rows(groups: list[records.RolloutGroup], *, run_id: str, step: int) -> list[dict[str, Any]]:
    """One dict per completion, matching ROLLOUTS_SCHEMA."""
    created = _now()
    rows = []
    for g in groups:
        for c in g.completions:
            rows.append(
                {
                    "run_id": run_id,
                    "split": g.split,
                    "step": step,
                    "policy_version": c.policy_version,
                    "policy_version_end": c.policy_version_end,
                    "server": c.server,
                    # training steps between the generating policy and the one trained at `step`
                    "staleness": max(0, step - c.policy_version),
                    "group_id": g.group_id,
                    "sample_index": c.sample_index,
                    "prompt_index": g.prompt_index,
                    "row_id": g.row_id,
                    "prompt": g.prompt_of(c),
                    "prompt_ids": g.prompt_ids_of(c),
                    "messages": [asdict(m) for m in c.messages],
                    "completion": c.completion,
                    "completion_ids": c.completion_ids,
                    "completion_mask": c.completion_mask,
                    "logprobs": c.logprobs,
                    "completion_tokens": len(c.completion_ids),
                    "num_turns": c.num_turns,
                    "turns": [
                        {
                            "prompt_tokens": t.prompt_tokens,
                            "output_tokens": t.output_tokens,
                            "duration_s": t.duration_s,
                            "finish_reason": t.finish_reason,
                        }
                        for t in c.turns
                    ],
                    "tool_calls": [asdict(tc) for tc in c.tool_calls],
                    "truncated": c.truncated,
                    "truncation_reason": c.truncation_reason,
                    "finish_reason": c.finish_reason,
                    "reward": c.reward,
                    "reward_valid": c.reward_valid,
                    "invalid_reason": c.invalid_reason,
                    "advantage": c.advantage,
                    "trained": c.trained,
                    "drop_reason": c.drop_reason,
                    "gen_seconds": c.gen_seconds,
                    "created_at": created,
                }
            )
    return rows


def reward_rows(groups: list[records.RolloutGroup], *, run_id: str, step: int) -> list[dict[str, Any]]:
    """One dict per (completion, reward function) cell, matching REWARDS_SCHEMA."""
    return [
        {
            "run_id": run_id,
            "split": g.split,
            "step": step,
            "group_id": g.group_id,
            "sample_index": c.sample_index,
            "reward_name": cell.name,
            "weight": cell.weight,
            "value": cell.value,
            "status": cell.status,
            "reason": cell.reason,
            "duration_s": cell.duration_s,
            "imputed": cell.imputed,
            "imputed_value": cell.imputed_value,
            "extra": None if cell.extra is None else json.dumps(cell.extra, allow_nan=False),
            "node": cell.node,
        }
        for g in groups
        for c in g.completions
        for cell in c.reward_cells
    ]


def groups_from_rows(
    rollouts: list[dict[str, Any]], rewards: list[dict[str, Any]]
) -> list[records.RolloutGroup]:
    """Rebuild groups from table rows (inverse of rollout_rows/reward_rows, environments excepted)."""
    cells = _cells_by_completion(rewards)
    groups: dict[str, records.RolloutGroup] = {}
    for r in rollouts:
        g = groups.get(r["group_id"])
        if g is None:
            g = groups[r["group_id"]] = records.RolloutGroup(
                group_id=r["group_id"],
                prompt_index=r["prompt_index"],
                prompt=r["prompt"],
                prompt_ids=list(r["prompt_ids"]),
                completions=[],
                split=r["split"],
                policy_version=r["policy_version"],
                row_id=r.get("row_id") or "",
            )
        g.policy_version = min(g.policy_version, r["policy_version"])
        g.completions.append(_completion_from_row(r, g, cells.get((r["group_id"], r["sample_index"]), [])))
    for g in groups.values():
        g.completions.sort(key=lambda c: c.sample_index)
    return list(groups.values())


def _cells_by_completion(rewards: list[dict[str, Any]]) -> dict[tuple[str, int], list[records.RewardCell]]:
    cells: dict[tuple[str, int], list[records.RewardCell]] = {}
    for r in rewards:
        cells.setdefault((r["group_id"], r["sample_index"]), []).append(
            records.RewardCell(
                name=r["reward_name"],
                value=r["value"],
                status=r["status"],
                reason=r["reason"] or "",
                weight=r["weight"],
                duration_s=r["duration_s"],
                # .get: reward files written before imputation existed lack both columns
                imputed=bool(r.get("imputed")),
                imputed_value=r.get("imputed_value"),
                extra=json.loads(r["extra"]) if r.get("extra") else None,
                node=r.get("node") or "",  # written before nodes were recorded: none
            )
        )
    return cells


def _completion_from_row(
    r: dict[str, Any], g: records.RolloutGroup, cells: list[records.RewardCell]
) -> records.RolloutCompletion:
    return records.RolloutCompletion(
        sample_index=r["sample_index"],
        completion=r["completion"],
        completion_ids=list(r["completion_ids"]),
        completion_mask=list(r["completion_mask"]),
        logprobs=list(r["logprobs"]),
        messages=[records.TaggedMessage(**m) for m in r["messages"]],
        turns=[records.TurnRecord(**t) for t in r["turns"]],
        tool_calls=[records.ToolCallRecord(**t) for t in r["tool_calls"]],
        truncated=r["truncated"],
        truncation_reason=r["truncation_reason"],
        finish_reason=r["finish_reason"],
        policy_version=r["policy_version"],
        policy_version_end=r["policy_version_end"],
        server=r.get("server"),
        gen_seconds=r["gen_seconds"],
        reward=r["reward"],
        reward_valid=r["reward_valid"],
        invalid_reason=r["invalid_reason"],
        reward_cells=cells,
        advantage=r["advantage"],
        trained=r["trained"],
        drop_reason=r["drop_reason"],
        # its own prompt only where it differs from the group's (per-sample reset notes)
        prompt_ids=None if list(r["prompt_ids"]) == g.prompt_ids else list(r["prompt_ids"]),
        prompt=None if r["prompt"] == g.prompt else r["prompt"],
    )
