"""How the vLLM server is launched on CPU: thread binding over every core this process may use."""

from __future__ import annotations

import os

import pytest

import grpoflow.flows.processes.serve as serve
import grpoflow.flows.processes.vllm_command as command
from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.processes.vllm_command import cpu_list, server_command

pytestmark = pytest.mark.unit


def test_cpu_list_compacts_core_ids_into_vllm_ranges():
    assert cpu_list({0}) == "0"
    assert cpu_list({1, 0}) == "0-1"
    assert cpu_list({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"


def test_cpu_server_binds_its_engine_to_all_our_cores_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    _, env, _ = server_command("m", python="py", port=9)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    _, env, _ = server_command("m", python="py", port=9)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_cpu_server_attention_is_unsplit_so_a_requests_numbers_are_its_own(monkeypatch):
    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.delenv("VLLM_CPU_ATTN_SPLIT_KV", raising=False)
    assert server_command("m", python="py", port=9)[1]["VLLM_CPU_ATTN_SPLIT_KV"] == "0"
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "1")  # the user's environment wins
    assert server_command("m", python="py", port=9)[1]["VLLM_CPU_ATTN_SPLIT_KV"] == "1"


def test_a_lora_server_loads_adapters_of_the_runs_rank_at_runtime(monkeypatch):
    from grpoflow.tasks.config.inference import InferenceConfig
    from grpoflow.tasks.config.learner import LoraConfig

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    cmd, env, _ = server_command("m", python="py", port=9, lora_rank=LoraConfig(rank=12).served_rank(),
                                 max_loras=InferenceConfig().max_loras)  # fmt: skip
    at = cmd.index("--enable-lora")
    assert cmd[at : at + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    cmd, env, _ = server_command("m", python="py", port=9)
    assert "--enable-lora" not in cmd and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


def test_a_server_keeps_uploaded_versions_in_a_folder_of_its_own(monkeypatch, tmp_path):
    monkeypatch.delenv("GRPOFLOW_UPLOAD_DIR", raising=False)
    assert "GRPOFLOW_UPLOAD_DIR" not in server_command("m", python="py", port=9)[1]  # uploads off
    monkeypatch.setenv("GRPOFLOW_UPLOAD_DIR", "/srv/uploads")  # the launcher's own setting passes
    assert server_command("m", python="py", port=9)[1]["GRPOFLOW_UPLOAD_DIR"] == "/srv/uploads"
    monkeypatch.chdir(tmp_path)
    upload_dir = serve.upload_dir_of("runs", "serve-8000")  # next to <root>/pids/serve-8000.json
    _, env, _ = server_command("m", python="py", port=9, upload_dir=upload_dir)
    assert env["GRPOFLOW_UPLOAD_DIR"] == str(tmp_path / "runs" / "uploads" / "serve-8000")


def test_the_machines_own_vllm_flags_follow_the_runs_and_are_checked_as_they_are(monkeypatch):
    from grpoflow.tasks.config.allowlist import NotAllowedError

    monkeypatch.setenv(command.SITE_ARGS_ENV, "--enforce-eager --max-num-seqs 8")
    cmd, _, _ = server_command("m", python="py", port=9, extra_args=("--seed", "3"))
    at = cmd.index("--seed")
    assert cmd[at : at + 5] == ["--seed", "3", "--enforce-eager", "--max-num-seqs", "8"]
    monkeypatch.setenv(command.SITE_ARGS_ENV, "--host 0.0.0.0")  # would undo the loopback default
    with pytest.raises(NotAllowedError, match="GRPOFLOW_VLLM_ARGS: --host is refused"):
        server_command("m", python="py", port=9)
    monkeypatch.delenv(command.SITE_ARGS_ENV)
    assert "--enforce-eager" not in server_command("m", python="py", port=9)[0]


def test_a_cpu_server_runs_its_one_worker_in_the_engine_process_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.delenv(command.SITE_ARGS_ENV, raising=False)
    cmd, env, _ = server_command("m", python="py", port=9)
    at = cmd.index("--distributed-executor-backend")
    assert cmd[at + 1] == "uni" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # vllm-cpu keeps uni only so
    for flags in (("--distributed-executor-backend", "mp"), ("--tensor-parallel-size=2",), ("-dp", "2")):
        cmd, env, _ = server_command("m", python="py", port=9, extra_args=flags)
        assert cmd.count("--distributed-executor-backend") == (flags[0] == "--distributed-executor-backend")
        assert "uni" not in cmd and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    monkeypatch.setattr(command, "cpu_only", lambda: False)  # a GPU: vLLM's own choice
    cmd, env, _ = server_command("m", python="py", port=9)
    assert "--distributed-executor-backend" not in cmd and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


CPUINFO = "processor\t: {i}\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 {extra}\n\n"


@pytest.mark.parametrize(
    ("extra", "native"),
    [("", False), ("avx512f avx512_bf16", True), ("amx_tile amx_bf16", True), ("avx512_bf16x", False)],
)
def test_a_cpu_computes_bf16_natively_only_with_amx_or_avx512_bf16(extra, native, tmp_path):
    from grpoflow.tasks.config.model import cpu_computes_bf16

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(CPUINFO.format(i=i, extra=extra) for i in range(2)))
    assert cpu_computes_bf16(cpuinfo) is native
    assert cpu_computes_bf16(tmp_path / "missing") is False  # not Linux: no claim of bf16


@pytest.mark.parametrize("bf16_cpu", [True, False])
def test_a_cpu_server_serves_bf16_for_a_bf16_learner_where_the_cpu_computes_it(bf16_cpu, monkeypatch):
    """The served dtype follows the learner's compute dtype where the hardware computes it: a CPU's
    server serves bfloat16 for `model.dtype: bfloat16` on a CPU with native bf16, outside
    `run.reproducible`; float32 in every other case, as before; a GPU's keeps the model's own."""
    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.setattr(command, "cpu_computes_bf16", lambda: bf16_cpu)
    monkeypatch.delenv(command.SITE_ARGS_ENV, raising=False)

    def served(dtype: str, reproducible: bool = False) -> str:
        return command.served_dtype(GRPOConfig(model={"dtype": dtype}, run={"reproducible": reproducible}))

    assert served("bfloat16") == ("bfloat16" if bf16_cpu else "float32")
    assert served("bfloat16", reproducible=True) == "float32"
    assert served("float32") == served("auto") == "float32"

    def dtype_of(**kw) -> str:
        cmd = server_command("m", python="py", port=9, **kw)[0]
        return cmd[cmd.index("--dtype") + 1]

    assert dtype_of() == "float32"  # a server nobody asked a dtype of: today's
    assert dtype_of(dtype=served("bfloat16")) == ("bfloat16" if bf16_cpu else "float32")
    monkeypatch.setattr(command, "cpu_only", lambda: False)
    assert served("bfloat16") == served("float32") == dtype_of() == "auto"


def test_a_cpu_bf16_server_runs_eager_whoever_asked_for_bf16(monkeypatch):
    """vllm-cpu 0.32's compiled bf16 model fails its first forward after an in-place reload: a CPU
    server whose final argv serves bfloat16 (vLLM keeps the last --dtype) runs eager, whether the run
    asked (dtype=), its config (inference.extra_args) or the site (GRPOFLOW_VLLM_ARGS)."""
    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.delenv(command.SITE_ARGS_ENV, raising=False)

    def eager(**kw) -> int:
        return server_command("m", python="py", port=9, **kw)[0].count("--enforce-eager")

    assert eager(dtype="bfloat16") == 1 and eager() == 0 and eager(dtype="float32") == 0
    assert eager(extra_args=("--dtype", "bfloat16")) == 1
    assert eager(extra_args=("--dtype=bfloat16",)) == 1
    assert eager(dtype="bfloat16", extra_args=("--dtype", "float32")) == 0  # the last --dtype is served
    assert eager(dtype="bfloat16", extra_args=("--enforce-eager",)) == 1  # never twice
    monkeypatch.setenv(command.SITE_ARGS_ENV, "--dtype bfloat16")
    assert eager() == 1
    monkeypatch.setattr(command, "cpu_only", lambda: False)  # a GPU compiles bf16 as it likes
    assert eager() == 0


def test_an_eager_cpu_server_compiles_nothing_unless_told_otherwise(monkeypatch):
    """Eager, vLLM still compiled the sampler's rank of a sampled token at its first logprobs request
    (tests/integration/test_server_env.py runs that op in the vLLM environment both ways)."""
    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.delenv(command.SITE_ARGS_ENV, raising=False)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)

    def env(**kw) -> dict[str, str]:
        return server_command("m", python="py", port=9, **kw)[1]

    assert env(dtype="bfloat16")["TORCH_COMPILE_DISABLE"] == "1"  # bf16 on a CPU runs eager
    assert env(extra_args=("--enforce-eager",))["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in env()  # compiled: vLLM compiles as it likes
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")  # the user's environment wins
    assert env(dtype="bfloat16")["TORCH_COMPILE_DISABLE"] == "0"


def test_a_cpu_server_spins_briefly_only_where_generation_and_training_take_turns(monkeypatch):
    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as tasks/__init__.py sets it for the learner
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = server_command("m", python="py", port=9, spin=True)[1]
    assert (env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"]) == ("ACTIVE", "300000")  # libgomp's default
    env = server_command("m", python="py", port=9)[1]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # the user's environment wins
    assert server_command("m", python="py", port=9, spin=True)[1]["GOMP_SPINCOUNT"] == "1000"
    sync, ahead = (GRPOConfig.model_validate({"algorithm": {"max_staleness": n}}) for n in (0, 1))
    assert command.takes_turns(sync) and not command.takes_turns(ahead)


def test_last_flag_is_the_value_argparse_keeps():
    argv = ["--dtype", "float32", "--model", "m", "--dtype=bfloat16"]
    assert command.last_flag(argv, "--dtype") == "bfloat16"
    assert command.last_flag([*argv, "--dtype", "half"], "--dtype") == "half"
    assert command.last_flag(["--dtype"], "--dtype") is None and command.last_flag([], "--dtype") is None
    assert command.last_flag(["--dtypes", "x"], "--dtype") is None
