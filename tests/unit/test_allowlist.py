"""Runs started by a Prefect worker import, read and contact only what the worker's settings allow;
the CLI on a user's own machine keeps its freedom unless the same settings are present."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.training.environments import check_run
from grpoflow.flows.training.preflight import preflight

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker(monkeypatch, tmp_path):
    """The environment Prefect's worker gives a flow-run process, with the worker's allow-lists."""
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "00000000-0000-0000-0000-000000000001")
    monkeypatch.delenv("GRPOFLOW_ALLOWED_MODULES", raising=False)
    monkeypatch.setenv("GRPOFLOW_ALLOWED_ROOTS", str(tmp_path))
    monkeypatch.delenv("GRPOFLOW_ALLOWED_SERVERS", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cfg(**sections) -> GRPOConfig:
    return GRPOConfig.model_validate({"storage": {"root": "runs"}, **sections})


@pytest.mark.parametrize(
    "section,field",
    [
        ({"tools": {"tools": ["os:system"]}}, "tools.tools[0]"),
        ({"rewards": [{"name": "r", "fn": "os:system"}]}, "rewards[0].fn"),
        ({"tools": {"environment": "grpoflow.examples.envs:random._os.system"}}, "tools.environment"),
        ({"rewards": [{"name": "r", "fn": "grpoflow.examples.rewards:_unit"}]}, "rewards[0].fn"),
        ({"data": {"generator": "examples_evil:rows"}}, "data.generator"),
    ],
)
def test_a_worker_run_imports_only_allowed_modules_and_public_names(worker, section, field):
    with pytest.raises(ConfigError, match=re.escape(field) + ": refused: .*GRPOFLOW_ALLOWED_MODULES"):
        check_run(cfg(**section))


def test_a_re_exported_object_from_another_module_is_refused(worker, monkeypatch):
    import grpoflow.examples.rewards  # noqa: F401  (binds the package; its attribute is used)
    from grpoflow import examples

    monkeypatch.setattr(examples.rewards, "shell", __import__("os").system, raising=False)
    with pytest.raises(ConfigError, match=r"rewards\[0\].fn: refused: .*module 'posix'"):
        check_run(cfg(rewards=[{"name": "r", "fn": "grpoflow.examples.rewards:shell"}]))
    check_run(cfg())  # the shipped examples are fine


def test_the_cli_keeps_its_freedom_without_the_settings(worker, monkeypatch):
    anything = cfg(tools={"tools": ["json:dumps"]})
    with pytest.raises(ConfigError, match=r"tools\.tools\[0\]: refused"):
        check_run(anything)  # a worker run: refused
    for k in (
        "PREFECT__FLOW_RUN_ID",
        "GRPOFLOW_ALLOWED_MODULES",
        "GRPOFLOW_ALLOWED_ROOTS",
        "GRPOFLOW_ALLOWED_SERVERS",
    ):
        monkeypatch.delenv(k, raising=False)
    check_run(anything)  # the same config: any importable callable, as today


def test_a_worker_run_reads_no_file_outside_its_roots_and_never_echoes_it(worker, tmp_path_factory):
    secret = tmp_path_factory.mktemp("elsewhere") / "data.jsonl"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    for path in (str(secret), "/etc/passwd"):
        with pytest.raises(ConfigError) as e:
            preflight(cfg(data={"path": path}))
        assert "data.path" in str(e.value) and "outside GRPOFLOW_ALLOWED_ROOTS" in str(e.value)
        assert "root:x" not in str(e.value)
    with pytest.raises(ConfigError, match="storage.root: .*outside"):
        preflight(GRPOConfig.model_validate({"storage": {"root": "/tmp/../etc"}}))
    with pytest.raises(ConfigError, match="config_file: .*outside"):
        load_config(REPO / "configs" / "tiny-letters.yaml")


def test_a_bad_row_is_named_without_its_content(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "ok"}\n{"secret": "hunter2"}\n')
    with pytest.raises(ConfigError) as e:
        preflight(cfg(data={"path": str(tmp_path / "d.jsonl")}))
    assert "row 1 has no 'prompt' field" in str(e.value) and "hunter2" not in str(e.value)


def test_a_worker_run_contacts_only_allowed_servers(worker, monkeypatch):
    with pytest.raises(ConfigError, match="inference.url: .*GRPOFLOW_ALLOWED_SERVERS"):
        preflight(cfg(inference={"url": "http://10.1.2.3:8000"}))
    monkeypatch.setenv("GRPOFLOW_ALLOWED_SERVERS", "http://127.0.0.1:8000")
    preflight(cfg(inference={"url": "http://127.0.0.1:8000/"}))
    # a Ray cluster is a server too (its GCS address, or Ray Client's ray:// URL); a local one is not
    for address, listed in (("10.1.2.3:6379", "ray://10.1.2.3:6379"), ("ray://10.1.2.3:10001",) * 2):
        with pytest.raises(
            ConfigError, match=f"scale.ray_address: '{listed}' is not in GRPOFLOW_ALLOWED_SERVERS"
        ):
            preflight(cfg(scale={"ray_address": address}))
    monkeypatch.setenv("GRPOFLOW_ALLOWED_SERVERS", "http://127.0.0.1:8000,ray://10.1.2.3:6379")
    preflight(cfg(scale={"ray_address": "10.1.2.3:6379"}))
    preflight(cfg(scale={"ray_address": "local"}))


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--trust-remote-code"],
                                  ["--middleware", "evil.Mw"]])  # fmt: skip
def test_server_flags_that_undo_safety_defaults_are_refused_everywhere(args, monkeypatch):
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    with pytest.raises(ConfigError, match="inference.extra_args: .* is refused"):
        preflight(cfg(inference={"extra_args": args}))


def test_a_worker_run_adds_only_tuning_flags(worker):
    with pytest.raises(ConfigError, match="--chat-template is not allowed"):
        preflight(cfg(inference={"extra_args": ["--chat-template", "/etc/passwd"]}))
    preflight(cfg(inference={"extra_args": ["--max-num-seqs", "8"]}))
