"""Looking at runs: the report's tables and plots (report.py, report_data.py, report_figures.py), the
rollout explorer (ui.py and its page in ui_static/), SQL over the rollout store (analyze.py), runs side
by side (compare.py), and experiment trackers fed from the `steps` table (tracking/). All of it reads
the store; none of it changes a run.
"""
