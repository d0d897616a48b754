"""A small MCP server for the tests, written with the registry's `mcp` package (2.x: MCPServer):
`python -m tests.integration.mcp_server` serves it over stdio (a process per connection: its `tally`
is per session), `... --port P` over streamable HTTP at http://127.0.0.1:P/mcp (one process, one tally)."""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer

server = MCPServer("grpoflow-test")
_total = {"n": 0}


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


@server.tool()
def tally(n: int) -> str:
    """Add n to this session's running total and return the total.

    Args:
        n: how much to add
    """
    _total["n"] += n
    return str(_total["n"])


@server.tool()
def fail(why: str) -> str:
    """Always fails.

    Args:
        why: the error message
    """
    raise ValueError(why)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args()
    if args.port is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
