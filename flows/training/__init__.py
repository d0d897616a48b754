"""Running a training: the `grpo_train` flow (train.py), its step loop (runner.py, step_close.py) over
the generation pipeline (pipeline.py), a run's bookkeeping (runs.py: preflight, the starting model and
its warm-up, opening or resuming a run), what a run shows while it trains (progress.py), the rows it
reads (data.py), and the tools and environments its config names (environments.py: `check_run`, the
checks a run's config passes before anything starts).
"""
