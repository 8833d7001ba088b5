"""Experiments: run a lab's scenarios under one workload and write a run directory.

The runner lives in `pdlab.experiment.runner` (ExperimentRun, run_workload, read_run); this package file
imports nothing, so `pdlab`'s command line starts without loading pandas and plotly.
"""
