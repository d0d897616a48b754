"""Processes: the long-lived things a run or a user starts and supervises. The vLLM server's start,
health and stop (launch.py, serve.py), the policy server flow that serves a lineage (policy_server.py),
the Ray cluster a run joins (cluster.py), and the Prefect API a command brings up for itself
(prefect_api.py).
"""
