"""An OpenEnv environment server as an environment (issue 48, part 2), with no wrapper class: the
environment `openenv init` writes (its echo template), served from `.venv-openenv` as its README says,
with two edits a test needs: every instance the server makes (one per session) appends a line to a file,
and a step whose message is "hang" sleeps past the tool timeout. The rollouts that call its tool are
driven by the SCRIPTED FAKE backend (tests/unit/scripted.py) on SmolLM2's real tokenizer and chat
template, so they do not depend on what a model samples; a short run trains on the real vLLM server."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from grpoflow.flows.processes.launch import ServerHandle, free_port
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.rollouts import ToolsConfig
from grpoflow.tasks.rewards.env_reward import ENVIRONMENT_REWARD
from grpoflow.tasks.rewards.score import score_groups
from tests.support import REPO
from tests.unit.scripted import scripted_groups, tool_call

pytestmark = pytest.mark.integration
OPENENV = REPO / ".venv-openenv" / "bin"


class EchoServer:
    def __init__(self, handle: ServerHandle, sessions: Path):
        self.handle, self.url, self.sessions_file = handle, handle.url, sessions

    def sessions(self) -> int:
        return len(self.sessions_file.read_text().splitlines()) if self.sessions_file.exists() else 0


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory):
    """`openenv init echo_env`, edited (the module doc), served on loopback; stopped with the module."""
    assert (OPENENV / "openenv").exists(), "no .venv-openenv: `make install` builds it"
    tmp = tmp_path_factory.mktemp("openenv")
    subprocess.run([str(OPENENV / "openenv"), "init", "echo_env"], cwd=tmp, check=True, capture_output=True)
    env_dir = tmp / "echo_env"
    app = env_dir / "server" / "app.py"
    app.write_text(_edit(app.read_text(), "max_concurrent_envs=1,", "max_concurrent_envs=16,"))
    impl = env_dir / "server" / "echo_env_environment.py"
    src = _edit(impl.read_text(), "        self._reset_count = 0\n",
                "        self._reset_count = 0\n        with open(os.environ['SESSIONS_FILE'], 'a') as f:\n"
                "            f.write('session\\n')\n")  # fmt: skip
    src = _edit(src, "        message = action.message\n",
                "        message = action.message\n        if message == 'hang':\n            time.sleep(20)\n")  # fmt: skip
    impl.write_text("import os\nimport time\n" + src)
    port, sessions = free_port(), tmp / "sessions.txt"
    cmd = [str(OPENENV / "python"), "-m", "uvicorn", "--app-dir", str(env_dir), "server.app:app",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = {**os.environ, "SESSIONS_FILE": str(sessions)}
    handle = ServerHandle(cmd, env, f"http://127.0.0.1:{port}", tmp / "server.log", 120.0).start()
    try:
        yield EchoServer(handle, sessions)
    finally:
        handle.stop()


CALC_ENV = """
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State


class TaskObservation(Observation):
    task: str = ""


class CalcEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calc")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            \"\"\"Add two integers.\"\"\"
            return a + b

        super().__init__(mcp)
        self._state = State(episode_id="calc", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        return TaskObservation(done=False, reward=0.0, task=f"Add the numbers of task {seed}.")

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=False, reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(CalcEnv, CallToolAction, CallToolObservation, env_name="calc", max_concurrent_envs=8)
"""


@pytest.fixture(scope="module")
def calc_env(tmp_path_factory):
    """An environment with MCP tools (OpenEnv's MCPEnvironment, as its docs write one), served on loopback."""
    tmp = tmp_path_factory.mktemp("openenv-mcp")
    (tmp / "calc_env.py").write_text(CALC_ENV)
    port = free_port()
    cmd = [str(OPENENV / "python"), "-m", "uvicorn", "--app-dir", str(tmp), "calc_env:app", "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    handle = ServerHandle(
        cmd, dict(os.environ), f"http://127.0.0.1:{port}", tmp / "server.log", 120.0
    ).start()
    try:
        yield handle.url
    finally:
        handle.stop()


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, f"the openenv template changed: {old!r} not found"
    return text.replace(old, new)


def _generate(tok, url: str, script, rows, **tools):
    return scripted_groups(tok, script, rows, ToolsConfig(environment=url, **tools))


def test_each_rollout_is_a_session_whose_tool_calls_and_reward_are_recorded(echo_env, smollm2_tokenizer_dir):
    """SmolLM2's template and its tool-call format: the model calls the environment's `step` tool (its
    action schema) and the step's observation is the tool message; the session's reward (reset's 0.0
    plus the step's 0.5) is a valid cell; each of the 4 rollouts opened a session of its own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)

    async def script(text, k, seed):  # the tool once, then an answer (its result is in the text then)
        return tool_call("step", message="hello") if "hello" not in text else "done"

    before = echo_env.sessions()
    rows = [{"prompt": [{"role": "user", "content": f"Greet {i}."}], "seed": i} for i in range(2)]
    groups = _generate(tok, echo_env.url, script, rows, env_slots=4)
    assert echo_env.sessions() - before == 4
    score_groups(groups, [RewardConfig(name="openenv", fn=ENVIRONMENT_REWARD)])
    for g in groups:
        assert (
            "Echo Env environment ready!" in g.prompt and '"step"' in g.prompt
        )  # reset's observation, the tool
        for c in g.completions:
            assert [(t.name, t.failed, t.result) for t in c.tool_calls] == [("step", False, "hello")]
            (cell,) = c.reward_cells
            assert (cell.name, cell.status, cell.value) == ("openenv", "valid", 0.5)
            assert c.environment["observations"][-1]["echoed_message"] == "hello"  # the rewards' snapshot


def test_an_environment_with_mcp_tools_gives_them_to_the_model(calc_env, smollm2_tokenizer_dir):
    """The environment's MCP tool list is the model's tools (the server's schema), each call a
    `call_tool` step; reset's observation is the prompt's note."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)

    async def once(text, k, seed):  # the tool, then an answer
        return tool_call("add", a=2, b=3) if text.count("<|im_start|>assistant") == 1 else "done"

    rows = [{"prompt": [{"role": "user", "content": "Calculate."}], "seed": 7}]
    (g,) = _generate(tok, calc_env, once, rows, env_slots=2)
    assert '"add"' in g.prompt and "Add the numbers of task 7." in g.prompt and '"step"' not in g.prompt
    for c in g.completions:
        assert [(t.name, t.failed, t.result) for t in c.tool_calls] == [("add", False, "5")]


def calc_examples() -> list[dict]:
    """Warm-up examples for the calc server (the `warmup.examples` of the test below)."""
    return [{"prompt": [{"role": "user", "content": "Calculate."}], "seed": i,
             "reply": tool_call("add", a=i, b=i + 1)} for i in range(3)]  # fmt: skip


def test_a_warm_up_learns_the_servers_tool_format_on_the_prompts_its_rollouts_see(
    calc_env, tmp_path, tiny_model_dir, smollm2_tokenizer_dir
):
    """A warm-up with an environment server (issue 60): each example opens a session as a rollout does,
    so it learns on exactly the prompt a rollout of that row gets (reset's note, the server's MCP tools
    in SmolLM2's system turn), and writes the warmed model."""
    from transformers import AutoTokenizer

    from grpoflow.tasks.config.algorithm import WarmupConfig
    from grpoflow.tasks.rollouts.templates import render
    from grpoflow.tasks.rollouts.tools import HermesToolParser
    from grpoflow.tasks.warmup import PromptRenderer, warm_up

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tools = ToolsConfig(environment=calc_env, env_slots=1)
    renderer = PromptRenderer(tok, tools, HermesToolParser())
    row = calc_examples()[2]
    messages, schemas = renderer.messages(row, 0), renderer.schemas(row)
    assert [s["function"]["name"] for s in schemas] == ["add"]

    async def answer(text, k, seed):
        return "done"

    (g,) = _generate(tok, calc_env, answer, [{k: v for k, v in row.items() if k != "reply"}], env_slots=1)
    assert g.prompt == render(tok, messages, schemas, True)  # the very prompt its rollouts get
    assert "Add the numbers of task 2." in g.prompt and '"add"' in g.prompt
    warmup = WarmupConfig(examples="tests.integration.test_openenv:calc_examples", steps=2, batch_size=3)
    stats = warm_up(tiny_model_dir, tmp_path / "warm", warmup, tools, log=lambda _: None)
    assert stats["n_examples"] == 3 and stats["steps"] == 2 and stats["loss_last"] is not None
    assert (tmp_path / "warm" / "model.safetensors").is_file()


def test_a_short_run_on_the_real_server_scores_with_the_environments_reward(
    echo_env, tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """No reward function and no wrapper: the config names the server; every rollout a session."""
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.sql import query

    config = tmp_path / "echo.yaml"
    config.write_text(f"""
model: {{path: {tiny_model_dir}}}
data: {{generator: "grpoflow.examples.envs:letters_rows", prompts_per_step: 2}}
generation: {{group_size: 2, max_tokens: 16, max_turns: 2}}
tools: {{environment: "{echo_env.url}"}}
run: {{steps: 1, run_id: oe}}
storage: {{root: {tmp_path}}}
inference: {{url: "{vllm_server.url}", max_model_len: 1024}}
""")
    cfg = load_config(config)  # names no reward: the environment's is the run's
    before = echo_env.sessions()
    assert grpo_train(config=cfg)["steps_trained"] == 1
    assert echo_env.sessions() - before == 4
    _, cells = query(tmp_path, "SELECT reward_name, status, count(*) FROM rewards GROUP BY ALL")
    assert cells == [("openenv", "valid", 4)]


def test_a_hung_step_times_out_and_a_dead_server_fails_the_cells_not_the_run(echo_env, smollm2_tokenizer_dir):
    """Last in the module: it stops the server."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)

    async def hang(text, k, seed):
        return tool_call("step", message="hang") if "timed out" not in text else "done"

    rows = [{"prompt": [{"role": "user", "content": "Wait."}]}]
    (g,) = _generate(tok, echo_env.url, hang, rows, env_slots=2, tool_timeout_s=1.0)
    score_groups([g], [RewardConfig(name="openenv", fn=ENVIRONMENT_REWARD)])
    for c in g.completions:
        assert [(t.failed, t.error) for t in c.tool_calls] == [(True, "tool step timed out after 1.0s")]
    echo_env.handle.kill()  # the server dies (SIGKILL)
    (g,) = _generate(tok, echo_env.url, hang, rows, env_slots=2)
    score_groups([g], [RewardConfig(name="openenv", fn=ENVIRONMENT_REWARD)])
    for c in g.completions:
        (cell,) = c.reward_cells
        assert cell.status == "failed" and "cannot open a session at" in cell.reason, cell.reason
        assert c.truncation_reason == "environment_unavailable" and not c.reward_valid
