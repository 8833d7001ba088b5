"""Experiments: run a lab's scenarios under one workload and write a run directory."""

from pdlab.experiment.runner import ExperimentRun, environment, new_run_dir, run_workload

__all__ = ["ExperimentRun", "environment", "new_run_dir", "run_workload"]
