"""Experiments: run a lab's scenarios under one workload and write a run directory."""
