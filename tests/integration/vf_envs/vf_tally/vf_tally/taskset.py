"""Tally n marks with the tool, then answer a follow-up turn. Rewards: `called_tally` (the tool's marks
reached the conversation), `said_done` (the reply to the follow-up says done)."""

import verifiers.v1 as vf

from vf_tally.servers.tally import TallyToolset

FOLLOW_UP = "Thanks. Now reply with the word done."


class TallyTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class TallyData(vf.TaskData):
    n: int


class TallyTask(vf.Task[TallyData, vf.State, TallyTaskConfig]):
    @classmethod
    def toolsets(cls, config: TallyTaskConfig) -> list[vf.Toolset]:
        return [TallyToolset(config.tools)]

    @vf.reward
    async def called_tally(self, trace: vf.Trace) -> float:
        return float(any(m.content == "|" * self.data.n for m in trace.tool_messages))

    @vf.reward
    async def said_done(self, trace: vf.Trace) -> float:
        return float("done" in (trace.last_reply or "").lower())


class TallyConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: TallyTaskConfig = TallyTaskConfig()


class TallyTaskset(vf.Taskset[TallyTask, TallyConfig]):
    def load(self) -> list[TallyTask]:
        return [
            TallyTask(
                TallyData(idx=i, prompt=f"Use the tally tool to count {i + 2} marks.", n=i + 2),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


class TallyEnv(vf.SingleAgentEnv):
    """The task's prompt, then one follow-up user turn once the model has answered."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            if not (await interaction.turn()).terminated:
                await interaction.turn(FOLLOW_UP)
