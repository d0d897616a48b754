"""How the vLLM server is launched on CPU: thread binding over every core this process may use."""

from __future__ import annotations

import os

import pytest

import flows.serve as serve
from flows.serve import cpu_list, server_command

pytestmark = pytest.mark.unit


def test_cpu_list_compacts_core_ids_into_vllm_ranges():
    assert cpu_list({0}) == "0"
    assert cpu_list({1, 0}) == "0-1"
    assert cpu_list({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"


def test_cpu_server_binds_its_engine_to_all_our_cores_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(serve, "_cpu_only", lambda: True)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    _, env, _ = server_command("m", python="py", port=9)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    _, env, _ = server_command("m", python="py", port=9)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
