"""The sections generation reads: `generation` (sampling and its budgets) and `tools` (tool functions,
environments, how the model is told about them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from grpoflow.tasks.config.section import Section, check_import_path_syntax, check_sendable


class GenerationConfig(Section):
    group_size: int = Field(
        8, ge=1, description="Completions per prompt (G); training needs at least 2 (evaluation may use 1)."
    )
    max_tokens: int = Field(16, ge=1, description="Max new tokens per generation turn.")
    temperature: float = Field(
        1.0,
        ge=0,
        description="Sampling temperature (the learner uses it too); 0 = greedy, for evaluation only.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens only (0: all).")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Drop tokens under min_p times the most likely token's probability."
    )
    repetition_penalty: float = Field(
        1.0, gt=0, description="vLLM's repetition penalty (1: none; above 1 discourages repeats)."
    )
    max_turns: int = Field(1, ge=1, description="Max model turns per rollout (tool calls in between).")
    max_rollout_tokens: int | None = Field(
        None, ge=1, description="Token budget over all turns of one rollout (None: max_tokens*max_turns)."
    )
    max_in_flight: int = Field(64, ge=1, description="Bound on concurrent generation requests.")
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end a completion where the model writes them (e.g. '\\nQuestion:' for a "
        "base model on a few-shot template): vLLM stops there, finish_reason 'stop'. The completion's "
        "tokens and logprobs are those vLLM generated, the stop string's included: the model is trained on "
        "what it wrote; rewards see its text.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Token ids that end a completion besides the tokenizer's EOS, kept as its last token.",
    )

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("an empty stop string would stop every completion at once")
        return v


def is_server_url(spec: Any) -> bool:
    """An environment given as a server's URL (an OpenEnv server: tasks/rollouts/openenv.py)."""
    return isinstance(spec, str) and spec.startswith(("http://", "https://", "ws://", "wss://"))


def _factory_syntax(spec: Any) -> Any:
    return check_import_path_syntax(spec) if isinstance(spec, str) and not is_server_url(spec) else spec


class McpServerConfig(Section):
    """One MCP server whose tools the model gets (tasks/rollouts/mcp_tools.py)."""

    name: str = Field(..., min_length=1, description="What errors and the docs call this server.")
    url: str | None = Field(
        None, description="A streamable-HTTP server's endpoint, e.g. 'http://host:8000/mcp'."
    )
    command: list[str] | None = Field(
        None,
        description="A stdio server: the command that starts it, e.g. ['python', '-m', 'my_server'] (on a Prefect "
        "worker only `python -m <module>` with the module allowed).",
    )
    per_rollout: bool = Field(
        False,
        description="One connection (and MCP session) per rollout, for a server that keeps per-session state; "
        "false: one per batch of rollouts, shared by its calls (cheaper: a stdio server starts once a batch).",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.url is None) == (self.command is None):
            raise ValueError(
                f"tools.mcp {self.name!r}: set exactly one of url (streamable HTTP) and command (stdio)"
            )
        if self.command is not None and not self.command:
            raise ValueError(f"tools.mcp {self.name!r}: command is empty")
        return self


class ToolsConfig(Section):
    tools: list[str | SkipJsonSchema[Callable[..., Any]]] = Field(
        default_factory=list,
        description="Tool functions, 'module:function' (from Python also the functions themselves).",
    )
    environment: (
        str | SkipJsonSchema[Callable[..., Any]] | dict[str, str | SkipJsonSchema[Callable[..., Any]]] | None
    ) = Field(
        None,
        description="Environment factory 'module:Class' (from Python also the class), or an OpenEnv "
        "server's URL 'http://host:port' (each rollout a session of its own, its MCP tools the model's), TRL's "
        "`environment_factory`: each rollout gets an instance, `reset(**row)` first (a string it returns is "
        "added to the prompt; with no dataset, `data.generator: null`, it is the prompt), and its public "
        "methods are the model's tools. A map {name: factory} is TRL's dict form: each row's `environment` "
        "column names the one its rollouts use, and they see only that one's tools. Each finished rollout's "
        "environment reaches the reward functions as an isolated snapshot: its own snapshot() when it "
        "defines one, else a deep copy.",
    )
    environment_reward: bool = Field(
        True,
        description="An environment with get_reward() is a reward of its own, as in TRL: named after its class, "
        "weight 1, called on the rollout's instance once the rollout ends (an exception, a non-number or a "
        "timeout is a failed cell, None an invalid one, never 0); without `rewards` in the config it is the "
        "only reward. In the dict form every environment must have one, and the reward is named "
        "'environment' unless they share a class. false: only `rewards` score.",
    )
    mcp: list[McpServerConfig] = Field(
        default_factory=list,
        description="MCP servers whose tools join the model's tools, with the schemas the servers give; their "
        "calls are recorded like any tool's. Needs pip install 'grpoflow[mcp]'.",
    )
    verifiers: dict[str, Any] | None = Field(
        None,
        description="A verifiers environment (verifiers 0.4, `verifiers.v1`): its `[env]` block as verifiers' TOML "
        "has it, e.g. {taskset: {id: 'my_env', num_tasks: 64}}. Rows come from its taskset, each episode runs "
        "through verifiers with every model turn on grpoflow's servers, and each of its rewards is a reward "
        "cell (tasks/rollouts/verifiers_env.py). Needs pip install 'grpoflow[verifiers]'.",
    )
    env_slots: int | None = Field(None, ge=1, description="Pooled environment instances (None: in-flight).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Timeout of one tool call.")
    executor: Literal["thread", "ray"] = Field(
        "thread",
        description="Where sync tool functions run: a thread, or a Ray task on the cluster of "
        "scale.ray_address. Environment methods and async tools always run locally.",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs one tool call reserves on Ray (executor: ray).")
    describe_tools: Literal["auto", "system", "template"] = Field(
        "auto",
        description="Where the model is told its tools and the call format: 'template' = the chat "
        "template's own rendering of `tools=`; 'system' = grpoflow writes them (and the format the tool "
        "call parser reads) into the system turn; 'auto' = 'system' when the chat template ignores "
        "`tools=` (SmolLM2's does), else 'template'.",
    )

    @field_validator("tools")
    @classmethod
    def _paths(cls, v: list[Any]) -> list[Any]:
        return [check_import_path_syntax(p) if isinstance(p, str) else p for p in v]

    @field_validator("environment")
    @classmethod
    def _env_path(cls, v: Any) -> Any:
        if isinstance(v, dict):
            if not v:
                raise ValueError("an empty map names no environment")
            for name in v:
                if not (isinstance(name, str) and name.strip()):
                    raise ValueError(f"environment names must be non-empty strings, got {name!r}")
            return {k: _factory_syntax(f) for k, f in v.items()}
        return _factory_syntax(v)

    @model_validator(mode="after")
    def _tools_can_travel(self) -> ToolsConfig:
        for i, t in enumerate(self.tools):
            check_sendable(t, f"tools.tools[{i}]", self.executor)
        return self

    def environments(self) -> dict[str | None, Any]:
        """The environment factories by the name a row's `environment` column gives (TRL's dict form);
        a single one under None. Empty without environments."""
        env = self.environment
        if env is None:
            return {}
        return dict(env) if isinstance(env, dict) else {None: env}
