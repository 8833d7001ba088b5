"""Benchmarks: measured side by side, written as JSON under data/results/ with the environment captured."""
