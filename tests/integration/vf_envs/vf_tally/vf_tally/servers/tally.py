"""The tally tool, an MCP server verifiers starts for each rollout (`python -m vf_tally.servers.tally`)."""

import verifiers.v1 as vf


class TallyToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def tally(self, n: int) -> str:
        """Count n marks.

        Args:
            n: how many
        """
        return "|" * n


if __name__ == "__main__":
    TallyToolset.run()
