"""Tools from MCP servers (issue 48, part 3): tests/integration/mcp_server.py, written with the registry's
`mcp` package, over stdio (a process per connection) and streamable HTTP. The rollouts that call its
tools are driven by the SCRIPTED FAKE backend (tests/unit/scripted.py) on SmolLM2's real tokenizer,
chat template and tool-call format, so nothing depends on what a model samples."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpoflow.flows.config import ConfigError, GRPOConfig
from grpoflow.flows.processes.launch import free_port
from grpoflow.flows.training.environments import check_run
from grpoflow.tasks.config.rollouts import McpServerConfig, ToolsConfig
from tests.support import REPO, wait_for
from tests.unit.scripted import scripted_groups, tool_call

pytestmark = pytest.mark.integration
STDIO = [sys.executable, "-m", "tests.integration.mcp_server"]


def add(a: int, b: int) -> int:
    """A function tool whose name an MCP server's tool also has.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.fixture(scope="module")
def http_server():
    """The test server over streamable HTTP on loopback, for the module."""
    port = free_port()
    proc = subprocess.Popen([*STDIO, "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        import socket

        def up() -> bool:
            assert proc.poll() is None, "the MCP server exited"
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(up, 60, "the MCP server")
        yield url
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def _generate(tok, script, mcp: list[McpServerConfig], rows=2, group_size=2):
    rows = [{"prompt": [{"role": "user", "content": f"Task {i}."}]} for i in range(rows)]
    return scripted_groups(tok, script, rows, ToolsConfig(mcp=mcp), group_size=group_size, max_turns=4)


def _turn(text: str) -> int:
    """The model turns before this one (SmolLM2's template opens each with this line)."""
    return text.count("<|im_start|>assistant") - 1


async def _tally_twice(text, k, seed):
    return tool_call("tally", n=2) if _turn(text) < 2 else "done"


def test_an_mcp_servers_tools_are_the_models_and_their_calls_are_recorded(tok, http_server, tmp_path):
    """Streamable HTTP, one connection for the batch: `add` as the server describes it, a result, and a
    tool that fails is a failed call, not a failed rollout."""

    async def script(text, k, seed):
        return [tool_call("add", a=2, b=3), tool_call("fail", why="nope"), "done"][min(_turn(text), 2)]

    groups = _generate(tok, script, [McpServerConfig(name="calc", url=http_server)])
    for g in groups:
        assert '"add"' in g.prompt and '"tally"' in g.prompt  # the server's tools, in SmolLM2's system turn
        for c in g.completions:
            got = [(t.name, t.failed, t.result if not t.failed else t.error) for t in c.tool_calls]
            assert got[0] == ("add", False, "5"), got
            assert got[1][:2] == ("fail", True) and "fail" in got[1][2]
            assert all(t.node for t in c.tool_calls)  # where it was called from: this process's node
    # stored as a run stores its rollouts: the calls are rows of the tool_calls view
    from grpoflow.storage.rollouts import RolloutStore
    from grpoflow.storage.sql import query

    RolloutStore(tmp_path).write_rollouts("mcp", 0, groups)
    _, rows = query(tmp_path, "SELECT name, failed, count(*) FROM tool_calls GROUP BY ALL ORDER BY name")
    assert rows == [("add", False, 4), ("fail", True, 4)]


def test_per_rollout_gives_each_rollout_its_own_session(tok):
    """stdio: `tally` keeps a total per MCP session. One connection per rollout: each rollout counts 2,
    4 from its own 0; one shared by the batch: the totals run on across rollouts (to 2 x 2 x 4)."""
    own = _generate(tok, _tally_twice, [McpServerConfig(name="t", command=STDIO, per_rollout=True)])
    for c in (c for g in own for c in g.completions):
        assert [t.result for t in c.tool_calls] == ["2", "4"]
    shared = _generate(tok, _tally_twice, [McpServerConfig(name="t", command=STDIO)])
    results = sorted(int(t.result) for g in shared for c in g.completions for t in c.tool_calls)
    assert results == list(range(2, 2 * 2 * 4 + 1, 2))


def test_bad_mcp_servers_fail_before_the_first_step_naming_the_field(http_server, monkeypatch):
    def cfg(server: dict, **tools) -> GRPOConfig:
        return GRPOConfig.model_validate({"tools": {"mcp": [server], **tools}})

    check_run(cfg({"name": "calc", "url": http_server}))  # reachable, no clash
    with pytest.raises(
        ConfigError, match=r"tools.mcp\[0\] \(calc\): its tool 'add' has the name of tools.tools\[0\]'s"
    ):
        check_run(cfg({"name": "calc", "url": http_server}, tools=[f"{__name__}:add"]))
    dead = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(ConfigError, match=rf"tools.mcp\[0\] \(gone\): cannot list the tools of {dead}: "):
        check_run(cfg({"name": "gone", "url": dead}))
    with pytest.raises(ValueError, match="set exactly one of url"):
        cfg({"name": "both", "url": http_server, "command": STDIO})
    # a worker-started run: a URL its worker allows, a stdio server only as `python -m <allowed module>`
    monkeypatch.setenv("GRPOFLOW_ALLOWED_SERVERS", "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"tools.mcp\[0\] \(calc\): .* is not in GRPOFLOW_ALLOWED_SERVERS"):
        check_run(cfg({"name": "calc", "url": http_server}))
    with pytest.raises(
        ConfigError, match=r"module 'tests.integration.mcp_server' is not in GRPOFLOW_ALLOWED_MODULES"
    ):
        check_run(cfg({"name": "t", "command": STDIO}))
    monkeypatch.delenv("GRPOFLOW_ALLOWED_SERVERS")
    # without the extra: one line that names it
    import grpoflow.tasks.rollouts.mcp_tools as m

    def missing():
        raise m.McpMissingError(f"tools.mcp needs the 'mcp' package: {m.MCP_EXTRA}")

    monkeypatch.setattr(m, "_mcp", missing)
    with pytest.raises(
        ConfigError,
        match=r"tools.mcp\[0\] \(calc\): tools.mcp needs the 'mcp' package: pip install 'grpoflow\[mcp\]'",
    ):
        check_run(cfg({"name": "calc", "url": http_server}))
