from vf_sum.taskset import SumTaskset

__all__ = ["SumTaskset"]
