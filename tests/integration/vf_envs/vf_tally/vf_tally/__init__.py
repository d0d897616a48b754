from vf_tally.taskset import TallyEnv, TallyTaskset

__all__ = ["TallyEnv", "TallyTaskset"]
