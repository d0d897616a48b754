"""The command line: `grpoflow` (main.py) parses a command and hands it to the flow it names. The
commands that run flows (train, evaluate, retrain, serve, report, ...) live in flow_commands.py, the
ones that only read or tidy the store (runs, sql, compact, promote, ...) in store_commands.py, and what
both share (config loading, Prefect's log noise) in shared.py. Nothing here holds a flow's logic: a
command checks its arguments, builds the config and calls a flow of another role.
"""
