"""Config tree: every shipped config parses; bad values fail early naming the field path."""

from pathlib import Path

import pytest
import yaml

from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.training.environments import check_run

pytestmark = pytest.mark.unit

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny-letters.yaml", "tiny-counter-env.yaml", "smollm2-tools.yaml", "smollm2-demo.yaml"} <= names
    assert any(n.startswith("gpu-") for n in names)


def _mismatches(given, got, beside: Path, where: str = "") -> list[str]:
    """Dotted paths where the file's value is not the loaded config's (a relative path may have been
    resolved next to the file)."""
    if isinstance(given, dict):
        return [m for k, v in given.items()
                for m in _mismatches(v, got.get(k) if isinstance(got, dict) else None, beside, f"{where}.{k}")]  # fmt: skip
    if isinstance(given, list) and isinstance(got, list) and len(given) == len(got):
        return [m for i, (a, b) in enumerate(zip(given, got, strict=True))
                for m in _mismatches(a, b, beside, f"{where}.{i}")]  # fmt: skip
    if given == got or (isinstance(given, str) and got == str(beside / given)):
        return []
    return [f"{where.lstrip('.')}: file {given!r}, config {got!r}"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses_and_imports(path):
    cfg = load_config(path)
    assert cfg.config_dir == path.resolve().parent
    # every value the file sets is the run's: no validator silently rewrote or dropped one
    assert _mismatches(yaml.safe_load(path.read_text()), cfg.model_dump(), cfg.config_dir) == []
    check_run(cfg)  # every reward/tool/env/generator import path resolves


def test_every_field_is_documented():
    def walk(model):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(GRPOConfig)


@pytest.mark.parametrize(
    "override, field",
    [
        ("generation.group_size=1", "generation.group_size"),
        ("algorithm.loss_type=ppo", "algorithm.loss_type"),
        ("learner.lr=-1", "learner.lr"),
        ("run.run_id=../escape", "run.run_id"),
        ("rewards=[{name: a, fn: nocolon}]", "rewards.0.fn"),
        ("generation.temprature=0.5", "generation.temprature"),
        ("learner.mini_batches=65", "learner.mini_batches"),  # 8 prompts x 8 completions = 64
        ("algorithm.num_iterations=0", "algorithm.num_iterations"),
        ("algorithm.correction_low=1.5", "algorithm.correction_low"),
        ("algorithm.baseline=loo", "algorithm.baseline"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field in str(e.value)


@pytest.mark.parametrize("written, means", [("on", "on"), ("off", "off"), ("auto", "auto")])
def test_sync_delta_written_bare_in_yaml_means_the_word(tmp_path, written, means):
    # YAML 1.1 reads a bare on/off as a boolean
    config = tmp_path / "c.yaml"
    shipped = (Path(__file__).parents[2] / "configs" / "tiny-letters.yaml").read_text()
    config.write_text(f"{shipped}\nsync:\n  delta: {written}\n")
    assert load_config(config).sync.delta == means
    assert load_config(None, [f"sync.delta={written}"]).sync.delta == means
    with pytest.raises(ConfigError, match="sync.delta"):
        load_config(None, ["sync.delta=sometimes"])


@pytest.mark.parametrize(
    "servers, field",
    [("inference.replicas=2", "inference.replicas"),
     ("inference.urls=[http://127.0.0.1:1, http://127.0.0.1:2]", "inference.urls")],
)  # fmt: skip
def test_a_reproducible_run_is_refused_more_than_one_server(servers, field):
    with pytest.raises(ConfigError, match=f"run.reproducible needs one server, but {field} names 2"):
        load_config(None, ["run.reproducible=true", servers])
    load_config(None, [servers])  # fine without it


def test_set_overrides_parse_yaml_values():
    cfg = load_config(None, ["generation.max_tokens=7", "data.shuffle=false", "run.run_id=abc-1"])
    assert cfg.generation.max_tokens == 7 and cfg.data.shuffle is False and cfg.run.run_id == "abc-1"
    assert cfg.config_dir is None  # no file: relative paths are the working directory's only


def test_missing_reward_import_is_named():
    cfg = load_config(None, ["rewards=[{name: r, fn: 'grpoflow.examples.rewards:does_not_exist'}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.fn"):
        check_run(cfg)


def test_duplicate_reward_names_rejected():
    with pytest.raises(ConfigError, match="duplicate"):
        load_config(None, ["rewards=[{name: r, fn: 'a:b'}, {name: r, fn: 'a:c'}]"])


def test_prefect_yaml_train_defaults_equal_the_tiny_letters_config():
    import yaml

    repo = Path(__file__).resolve().parents[2]
    deployments = {d["name"]: d for d in yaml.safe_load((repo / "prefect.yaml").read_text())["deployments"]}
    assert set(deployments) == {
        "grpo-train",
        "grpo-retrain",
        "grpo-evaluate",
        "policy-server",
        "rollout-sql",
        "rollout-explorer",
    }
    inline = GRPOConfig.model_validate(deployments["grpo-train"]["parameters"]["config"])
    assert inline.model_dump() == load_config(repo / "configs" / "tiny-letters.yaml").model_dump()
    assert deployments["grpo-retrain"]["concurrency_limit"] == {
        "limit": 1,
        "collision_strategy": "CANCEL_NEW",
    }


def test_prefect_yaml_parameters_fit_their_flows():
    """Every deployment's parameters are ones its flow takes, of the right types; shared pieces come
    from `definitions:` by alias, and the config files named there load."""
    import importlib

    import yaml

    repo = Path(__file__).resolve().parents[2]
    shipped = yaml.safe_load((repo / "prefect.yaml").read_text())
    assert {"work_pools", "config_file"} <= set(shipped["definitions"])
    for d in shipped["deployments"]:
        path, name = d["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
        flow.validate_parameters(d.get("parameters", {}))  # raises on unknown names or bad types
        assert d["work_pool"] in shipped["definitions"]["work_pools"].values(), d["name"]
        if "config_file" in d.get("parameters", {}):
            assert d["parameters"]["config_file"] == shipped["definitions"]["config_file"]
            load_config(repo / d["parameters"]["config_file"])


@pytest.mark.parametrize(
    "text, field",
    [
        ("model: {path: my-model}\ndata: {path: rows.jsonl}\n", "rewards"),
        ("rewards: []\ndata: {path: rows.jsonl}\n", "rewards"),
        ("rewards: [{name: r, fn: 'task:r'}]\n", "data"),
        ("rewards: [{name: r, fn: 'task:r'}]\ndata: {prompts_per_step: 4}\n", "data"),
    ],
)
def test_a_config_file_that_names_no_reward_or_no_data_is_refused_naming_the_field(tmp_path, text, field):
    # The defaults are the tiny demo's task: a user's config must never train on them unseen.
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{cfg}: {field}: the config names no")
    load_config(None)  # no config file: the demo, as before


def test_a_config_file_may_name_its_reward_or_data_by_set(tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("rewards: [{name: r, fn: 'grpoflow.examples.rewards:letter_fraction'}]\n")
    assert load_config(cfg, ["data.generator=grpoflow.examples.envs:letters_rows"]).rewards[0].name == "r"


def test_the_servers_key_comes_from_the_environment_and_is_never_written(tmp_path, monkeypatch):
    """inference.api_key: $GRPOFLOW_API_KEY unless set; never in the run's record (runs/<run>.json,
    which the explorer shows), a tracker's params, `grpoflow config show` or a serialized config (what
    Prefect keeps of a flow run's parameters)."""
    import json

    from grpoflow.flows.config_docs import render_yaml
    from grpoflow.flows.training.runs import RunState, write_meta
    from grpoflow.flows.viewing.tracking.tracker_api import config_params

    tiny = CONFIGS[0].parent / "tiny-letters.yaml"
    monkeypatch.delenv("GRPOFLOW_API_KEY", raising=False)
    assert load_config(tiny).inference.api_key is None
    monkeypatch.setenv("GRPOFLOW_API_KEY", "from-env-s3cret")
    cfg = load_config(tiny, [f"storage.root={tmp_path}"])
    assert cfg.inference.api_key == "from-env-s3cret"
    assert load_config(tiny, ["inference.api_key=given-s3cret"]).inference.api_key == "given-s3cret"
    given = load_config(tiny, [f"storage.root={tmp_path}", "inference.api_key=given-s3cret"])
    write_meta(given, RunState("r", 0, 0, "m", "m", None, False), "running")
    texts = {
        "run record": (tmp_path / "runs" / "r.json").read_text(),
        "tracker params": json.dumps(config_params(given)),
        "config show": render_yaml(given),
        "serialized": given.model_dump_json(),
    }
    assert {k: "s3cret" in t for k, t in texts.items()} == dict.fromkeys(texts, False)
    assert "inference" in json.loads(texts["run record"])["config"]  # the rest of the section is there
    # the serialized config loads back, its key from the environment of whoever loads it
    assert GRPOConfig.model_validate_json(texts["serialized"]).inference.api_key == "from-env-s3cret"
