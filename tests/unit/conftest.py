"""Fixtures of the unit tier that several modules share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray per test module (starting one costs seconds; a session-long one would keep later
    tests, whose flows start a Ray of their own, from connecting), run with a user project: a config
    file and a module beside it (test_ray.py's; the config's folder is added to this process's import
    path by load_config, as in a run). Yields (the cluster, the project's folder)."""
    pytest.importorskip("ray")
    from flows.cluster import ray_cluster
    from flows.config import load_config
    from tasks.config import RewardConfig
    from tests.unit.test_ray import CONFIG, USER_FNS, _score

    project = tmp_path_factory.mktemp("project")
    (project / "config.yaml").write_text(CONFIG)
    (project / "ray_user_fns.py").write_text(USER_FNS)
    cfg = load_config(project / "config.yaml")
    with ray_cluster(cfg.scale, cfg._config_dir) as c:
        _score([RewardConfig(name="length", fn="ray_user_fns:length", executor="ray")])  # warm workers
        yield c, project
