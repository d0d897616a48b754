"""The `data` section: where a run's rows come from (a file, a Hugging Face dataset or a generator)
and which of them are held out for evaluation."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from grpoflow.tasks.config.section import Section

# datasets' packaged builders: a `data.dataset.path` naming one is a loader, not a file or directory.
HF_BUILDERS = frozenset(
    {"arrow", "audiofolder", "csv", "imagefolder", "json", "pandas", "parquet", "pdffolder", "sql", "text",
     "videofolder", "webdataset", "xml"}
)  # fmt: skip  # a word list: one builder name a line would read no better, 13 lines longer


class DatasetConfig(Section):
    """A Hugging Face dataset, loaded by `datasets.load_dataset(path, name, split=, data_files=)`."""

    path: str = Field(
        ...,
        min_length=1,
        description="What datasets.load_dataset loads: a builder (json, parquet, csv, ...) with "
        "data_files, a local dataset directory (one written by save_to_disk is read with load_from_disk), "
        "or a Hub name: that needs network access, except for a dataset already in the local HF cache "
        "(which works offline, e.g. with HF_DATASETS_OFFLINE=1). Needs pip install 'grpoflow[datasets]'.",
    )
    name: str | None = Field(None, description="The dataset's configuration name (load_dataset's `name`).")
    split: str = Field(
        "train",
        min_length=1,
        description="The split to train on (load_dataset's slicing, e.g. 'train[:1000]', works except for a "
        "save_to_disk directory).",
    )
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        None,
        description="Files for a builder: a path, a list of paths, or {split: path(s)}. Relative to the "
        "current directory, else to the config file's; relative to `path` when that is a directory.",
    )

    def is_builder(self) -> bool:
        """Whether `path` names one of datasets' packaged builders (json, parquet, ...), not a path."""
        return self.path in HF_BUILDERS

    def file_list(self) -> list[str]:
        """Every entry of `data_files`, flattened."""
        f = self.data_files
        if f is None:
            return []
        if isinstance(f, dict):
            return [x for v in f.values() for x in ([v] if isinstance(v, str) else v)]
        return [f] if isinstance(f, str) else list(f)


class DataConfig(Section):
    path: str | None = Field(
        None,
        description="JSONL or Parquet file of rows, or a directory written by datasets' "
        "Dataset.save_to_disk / DatasetDict.save_to_disk; each row needs 'prompt'.",
    )
    dataset: DatasetConfig | None = Field(
        None,
        description="A Hugging Face dataset (datasets.load_dataset) instead of data.path or data.generator.",
    )
    split: str = Field(
        "train",
        min_length=1,
        description="The split to train on when data.path is a DatasetDict directory (data.dataset uses "
        "data.dataset.split).",
    )
    generator: str | None = Field(
        "grpoflow.examples.envs:letters_rows",
        description="Import path 'module:function' returning a list of rows; used when path is unset. null with "
        "no path or dataset: the prompts come from tools.environment's reset(), run.steps x prompts_per_step "
        "of them (each row carries `seed`, the same for a group's samples).",
    )
    generator_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the generator."
    )
    prompts_per_step: int = Field(8, ge=1, description="Dataset rows (groups) per training step.")
    shuffle: bool = Field(True, description="Shuffle rows each epoch (seeded by run.seed).")
    eval_path: str | None = Field(
        None,
        description="JSONL or Parquet file of held-out eval rows (grpo-evaluate's default rows); training "
        "rows with the same id (their `id` field, else a hash of the row) are never trained on.",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Hold out this fraction of the rows for evaluation, chosen by a hash of each row's id: "
        "the same rows stay held out across runs, resumes and data growth (0: none).",
    )
    eval_split: str | None = Field(
        None,
        description="A split of the same Hugging Face dataset (data.dataset, or a DatasetDict directory in "
        "data.path) whose rows are the eval rows, handled like data.eval_path.",
    )
    eval_generator_kwargs: dict[str, Any] | None = Field(
        None,
        description="With data.generator: the eval rows are the generator's rows for generator_kwargs updated "
        "by these (e.g. {part: eval}), handled like data.eval_path.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        # generator has a default: a path or a dataset takes precedence over it
        if self.path and self.dataset:
            raise ValueError("data.dataset: set data.path or data.dataset, not both")
        # no source at all: the environment's reset() gives the prompts (flows/config.py checks it has one)
        if self.eval_path and self.eval_fraction:
            raise ValueError("set data.eval_path or data.eval_fraction, not both")
        for other in ("eval_path", "eval_fraction"):
            if self.eval_split and getattr(self, other):
                raise ValueError(f"data.eval_split: set data.eval_split or data.{other}, not both")
        if self.eval_generator_kwargs is not None:
            if self.path or self.dataset:
                raise ValueError(
                    "data.eval_generator_kwargs: needs data.generator (not data.path or data.dataset)"
                )
            for other in ("eval_path", "eval_fraction", "eval_split"):
                if getattr(self, other):
                    raise ValueError(f"data.eval_generator_kwargs: set it or data.{other}, not both")
        if self.eval_split and not self.path and not self.dataset:
            raise ValueError("data.eval_split: needs data.dataset or a DatasetDict directory in data.path")
        return self
