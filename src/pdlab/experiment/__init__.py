"""Experiments: run a lab's scenarios under one workload and write a run directory."""

from pdlab.experiment.runner import ExperimentRun, RunData, environment, new_run_dir, read_run, run_workload

__all__ = ["ExperimentRun", "RunData", "environment", "new_run_dir", "read_run", "run_workload"]
