"""Running a training: the `grpo_train` flow (train.py), its step loop (runner.py, step_close.py) over
the generation pipeline (pipeline.py), a run's setup and bookkeeping (runs.py: ids, meta, resume,
warm-up; progress.py: what a running step reports), the prompts it reads (data.py), and the tools and
environments a run's config names (environments.py: checked once when a run is set up, before anything
starts).
"""
