"""A run's dataset rows: JSONL/Parquet files, Hugging Face datasets (a save_to_disk directory, or
`data.dataset` through datasets.load_dataset) or a generator; the eval split; the rows of each step.

Everything here fails early with a ConfigError naming the field, row or path, before any model loads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from grpoflow.flows.config import ConfigError, GRPOConfig, resolve_import, where_searched
from grpoflow.flows.training.environments import environment_rows, owns_its_data, verifiers_rows
from grpoflow.storage.ids import held_out, row_id_of
from grpoflow.tasks.config.allowlist import NotAllowedError, check_path
from grpoflow.tasks.config.data import DatasetConfig


def _read_rows(path: str, field: str, cfg: GRPOConfig) -> list[dict[str, Any]]:
    p = Path(path)
    if p.is_dir():  # written by datasets' save_to_disk
        saved = _load_saved(p, field)
        if field == "data.path":
            return _rows_of(_pick_split(saved, cfg.data.split, "data.split", p))
        if _is_dataset_dict(saved):
            raise ConfigError(
                f"{field}: {p} is a DatasetDict (splits: {', '.join(saved)}); point {field} at one split's "
                "directory, or use data.eval_split"
            )
        return _rows_of(saved)
    if not p.is_file():
        raise ConfigError(f"{field}: file not found: {where_searched(cfg, path)}")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    rows = []
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{field}: {p} line {i + 1}: invalid JSON: {e}") from None
    return rows


def _check_rows(rows: list[Any], where: str) -> None:
    if not rows:
        raise ConfigError(f"{where}: the dataset is empty")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "prompt" not in row:
            # the row's keys, not its content: the file may hold what its reader must not see
            keys = sorted(row)[:10] if isinstance(row, dict) else type(row).__name__
            raise ConfigError(f"{where}: row {i} has no 'prompt' field (found {keys})")
        prompt = row["prompt"]
        if not isinstance(prompt, str | list) or not prompt:
            raise ConfigError(f"{where}: row {i}: 'prompt' must be a non-empty string or message list")


# --- Hugging Face datasets (the optional `datasets` extra, imported only here) --------------------------


def _datasets(field: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{field}: loading Hugging Face datasets needs the 'datasets' package: "
            "pip install 'grpoflow[datasets]'"
        ) from None
    return datasets


def _first_line(e: BaseException) -> str:
    """`Type: first line of the message` (and of its cause's, which datasets' wrappers hide): never
    datasets' multi-line text."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    out = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return f"{out} ({_first_line(e.__cause__)})" if e.__cause__ is not None else out


def _is_saved(p: Path) -> bool:
    """Whether `p` is a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def _is_dataset_dict(ds: Any) -> bool:
    return isinstance(ds, dict)  # datasets.DatasetDict is a dict of splits; a Dataset is not


def _load_saved(p: Path, field: str) -> Any:
    if not _is_saved(p):
        raise ConfigError(
            f"{field}: {p} is not a saved dataset (no state.json or dataset_dict.json, as "
            "Dataset.save_to_disk / DatasetDict.save_to_disk write)"
        )
    datasets = _datasets(field)
    with _quiet(datasets):
        try:
            return datasets.load_from_disk(str(p))
        except Exception as e:
            raise ConfigError(f"{field}: cannot load {p}: {_first_line(e)}") from None


def _pick_split(ds: Any, split: str, field: str, where: Any) -> Any:
    """`ds` itself (a Dataset), or its split `split` (a DatasetDict)."""
    if not _is_dataset_dict(ds):
        if field == "data.eval_split":
            raise ConfigError(f"data.eval_split: {where} is a single Dataset, not a DatasetDict with splits")
        return ds
    if split not in ds:
        raise ConfigError(f"{field}: no split {split!r} in {where} (splits: {', '.join(ds)})")
    return ds[split]


def _rows_of(ds: Any) -> list[dict[str, Any]]:
    """A Dataset's rows as plain Python (message lists as lists of dicts)."""
    return ds.to_list()


class _quiet:
    """datasets' progress bars and log lines off while it loads: its errors reach the user as one
    ConfigError line, and the CLI's output stays its own."""

    def __init__(self, datasets: Any) -> None:
        self.datasets = datasets

    def __enter__(self) -> None:
        self.was_on = self.datasets.is_progress_bar_enabled()
        self.verbosity = self.datasets.logging.get_verbosity()
        self.datasets.disable_progress_bars()
        self.datasets.logging.set_verbosity(self.datasets.logging.CRITICAL)

    def __exit__(self, *exc: object) -> None:
        self.datasets.logging.set_verbosity(self.verbosity)
        if self.was_on:
            self.datasets.enable_progress_bars()


def _data_files_base(ds: Any) -> Path:
    """What `data.dataset.data_files` are relative to: the dataset's directory, else the current one."""
    p = Path(ds.path).expanduser()
    return p if not ds.is_builder() and p.is_dir() else Path.cwd()


def _looks_local(path: str) -> bool:
    """A path rather than a Hub name ('name' or 'owner/name')."""
    return Path(path).is_absolute() or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path


def _check_dataset_files(cfg: GRPOConfig) -> None:
    """data.dataset's local path and data_files exist (globs and URLs are left to datasets)."""
    ds = cfg.data.dataset
    assert ds is not None
    if not ds.is_builder() and _looks_local(ds.path) and not Path(ds.path).expanduser().exists():
        raise ConfigError(f"data.dataset.path: not found: {where_searched(cfg, ds.path)}")
    base = _data_files_base(ds)
    for f in ds.file_list():
        if "://" in f or any(c in f for c in "*?["):
            continue
        if not (base / Path(f).expanduser()).exists():
            shown = where_searched(cfg, f) if base == Path.cwd() else str(base / f)
            raise ConfigError(f"data.dataset.data_files: file not found: {shown}")


def _load_dataset(cfg: GRPOConfig, split: str, field: str) -> list[dict[str, Any]]:
    """The rows of split `split` (named by `field`) of `data.dataset`."""
    ds = cfg.data.dataset
    assert ds is not None
    _check_dataset_files(cfg)
    p = Path(ds.path).expanduser()
    if not ds.is_builder() and _is_saved(p):  # save_to_disk's format is load_from_disk's, not load_dataset's
        return _rows_of(_pick_split(_load_saved(p, "data.dataset.path"), split, field, ds.path))
    datasets = _datasets("data.dataset")
    args = {"path": ds.path, "name": ds.name, "data_files": ds.data_files}
    with _quiet(datasets):
        try:
            return _rows_of(datasets.load_dataset(**args, split=split))
        except ValueError as e:
            if not str(e).startswith("Unknown split"):
                raise ConfigError(f"data.dataset: cannot load {ds.path!r}: {_first_line(e)}") from None
            try:
                splits = ", ".join(datasets.load_dataset(**args))
            except Exception:
                splits = "?"
            raise ConfigError(f"{field}: no split {split!r} in {ds.path} (splits: {splits})") from None
        except Exception as e:
            raise ConfigError(f"data.dataset: cannot load {ds.path!r}: {_first_line(e)}") from None


def load_rows(cfg: GRPOConfig) -> list[dict[str, Any]]:
    """Every dataset row, from `data.path` (JSONL/Parquet, or a save_to_disk directory), `data.dataset`
    (a Hugging Face dataset) or `data.generator` (none of them: an environment's,
    flows/training/environments.py); each needs a 'prompt'. Training and evaluation take their sides of it
    from `split_rows`."""
    if cfg.data.path:
        rows = _read_rows(cfg.data.path, "data.path", cfg)
    elif cfg.data.dataset is not None:
        rows = _load_dataset(cfg, cfg.data.dataset.split, "data.dataset.split")
    elif cfg.tools.verifiers is not None:
        return verifiers_rows(cfg)
    elif owns_its_data(cfg):
        return environment_rows(cfg)
    else:
        gen = resolve_import(cfg.data.generator, "data.generator")
        rows = list(gen(**cfg.data.generator_kwargs))
    _check_rows(rows, "data")
    return rows


def split_rows(
    cfg: GRPOConfig, rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, eval rows) of the dataset `rows`.

    `data.eval_path` (or `data.eval_split`, a split of the same Hugging Face dataset, or the generator's
    rows for `data.eval_generator_kwargs`): its rows are the eval split, and training rows with one of their ids are left out of training. `data.eval_fraction`:
    a row is held out by a hash of its id (`held_out`), so the same rows are held out in every run and
    resume, and as the data grows. None of them: no eval split."""
    d = cfg.data
    if d.eval_path or d.eval_split or d.eval_generator_kwargs is not None:
        if d.eval_generator_kwargs is not None:
            field = "data.eval_generator_kwargs"
            gen = resolve_import(d.generator, "data.generator")
            eval_rows = list(gen(**{**d.generator_kwargs, **d.eval_generator_kwargs}))
        elif d.eval_split:
            field, eval_rows = "data.eval_split", _eval_split_rows(cfg)
        else:
            field, eval_rows = "data.eval_path", _read_rows(d.eval_path, "data.eval_path", cfg)
        _check_rows(eval_rows, field)
        ids = {row_id_of(r) for r in eval_rows}
        train = [r for r in rows if row_id_of(r) not in ids]
    elif d.eval_fraction > 0:
        train, eval_rows = [], []
        for r in rows:
            (eval_rows if held_out(row_id_of(r), d.eval_fraction) else train).append(r)
    else:
        return rows, []
    if not train:
        raise ConfigError(f"data: all {len(rows)} rows are eval rows; none is left to train on")
    return train, eval_rows


def _eval_split_rows(cfg: GRPOConfig) -> list[dict[str, Any]]:
    """The rows of `data.eval_split`: a split of data.dataset, or of the DatasetDict in data.path."""
    d = cfg.data
    assert d.eval_split
    if d.dataset is not None:
        return _load_dataset(cfg, d.eval_split, "data.eval_split")
    p = Path(d.path or "")
    if not p.is_dir():
        raise ConfigError(f"data.eval_split: data.path {d.path} is a file, not a DatasetDict directory")
    return _rows_of(_pick_split(_load_saved(p, "data.path"), d.eval_split, "data.eval_split", p))


def rows_for_step(
    rows: list[dict[str, Any]], step: int, per_step: int, *, seed: int, shuffle: bool
) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows of training step `step` and their global cursor positions.

    The cursor is a pure function of the step (position = step * per_step + i; epoch e uses a
    permutation seeded by (seed, e)), so a resumed run continues exactly where it stopped.
    """
    n = len(rows)
    cursor = [step * per_step + i for i in range(per_step)]
    out = []
    perms: dict[int, list[int]] = {}
    for pos in cursor:
        epoch, k = divmod(pos, n)
        if epoch not in perms:
            order = list(range(n))
            if shuffle:
                random.Random(seed * 1_000_003 + epoch).shuffle(order)
            perms[epoch] = order
        out.append(rows[perms[epoch][k]])
    return out, cursor


def confine_dataset(ds: DatasetConfig) -> None:
    """`data.dataset`'s local paths inside the worker's allow-lists (tasks/config/allowlist.py); its files
    are read locally only."""
    if not ds.is_builder():
        if not Path(ds.path).exists():  # a Hub name: load_dataset would download from the network
            raise NotAllowedError(
                f"data.dataset.path: {ds.path!r} is not a local path; this run reads local files only"
            )
        check_path(ds.path, "data.dataset.path")
    for f in ds.file_list():
        if "://" in f:
            raise NotAllowedError(f"data.dataset.data_files: {f!r} is a URL; this run reads local files only")
        check_path(_data_files_base(ds) / f, "data.dataset.data_files")
