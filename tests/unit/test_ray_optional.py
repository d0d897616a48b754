"""Ray without a cluster: `executor: ray` and `learner.world_size` > 1 without `scale.ray_address` are
config errors that name the fields, and Ray is never imported unless a config asks for it. The tests
with a real local Ray are tests/integration/test_ray.py and test_distributed.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from grpoflow.flows.config import ConfigError, load_config
from tests.support import REPO

pytestmark = pytest.mark.unit


def test_ray_executor_without_a_cluster_address_names_the_field(tmp_path):
    cfg = tmp_path / "c.yaml"
    letters = "data: {generator: 'grpoflow.examples.envs:letters_rows'}\n"
    cfg.write_text(
        letters + "rewards: [{name: a, fn: 'grpoflow.examples.rewards:letter_fraction', executor: ray}]\n"
    )
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.executor is 'ray' but scale\.ray_address"):
        load_config(cfg)
    cfg.write_text(
        letters
        + "rewards: [{name: a, fn: 'grpoflow.examples.rewards:letter_fraction'}]\ntools: {executor: ray}\n"
    )
    with pytest.raises(ConfigError, match=r"tools\.executor is 'ray' but scale\.ray_address"):
        load_config(cfg)


def test_ray_is_not_imported_unless_asked():
    code = textwrap.dedent(
        """
        import asyncio, json, sys
        import grpoflow.flows.lineage.evaluate, grpoflow.flows.training.train
        from grpoflow.flows.processes.cluster import ray_cluster
        from grpoflow.flows.config import GRPOConfig
        from grpoflow.tasks.rewards.score import score_groups
        from grpoflow.tasks.rollouts.tools import ParsedCall, ToolBox
        from tests.support import make_groups

        cfg = GRPOConfig()
        with ray_cluster(cfg.scale) as c:
            cluster = repr(c)
            score_groups(make_groups(), cfg.rewards)
            box = ToolBox({"f": lambda: 1})
            asyncio.run(box.call(ParsedCall("f", {}, "{}"), turn=1))
        print(json.dumps({"cluster": cluster, "ray_imported": "ray" in sys.modules}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # no cluster started, and scoring and a tool call ran without importing Ray
    assert json.loads(out.stdout.splitlines()[-1]) == {"cluster": "None", "ray_imported": False}


def test_world_size_above_one_needs_a_ray_address(tmp_path):
    from grpoflow.flows.config import ConfigError, load_config

    (tmp_path / "c.yaml").write_text(
        "learner: {world_size: 2}\ndata: {generator: 'grpoflow.examples.envs:letters_rows'}\n"
        "rewards: [{name: a, fn: 'grpoflow.examples.rewards:letter_fraction'}]\n"
    )
    with pytest.raises(ConfigError, match=r"learner\.world_size is 2 .* but scale\.ray_address is not set"):
        load_config(tmp_path / "c.yaml")
