"""The environment a measurement records: the processor beyond its marketing name."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from pdlab.environment import ISA_FLAGS, capture, cpu_identity


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo")
def test_cpu_identity_names_the_chip_its_features_and_cache() -> None:
    identity = cpu_identity()
    if platform.machine() in ("x86_64", "AMD64"):
        assert identity["family"].isdigit() and identity["model"].isdigit()
        assert "avx2" in identity["isa"] or "avx2" not in Path("/proc/cpuinfo").read_text()
    assert set(identity["isa"]) <= set(ISA_FLAGS)
    if Path("/sys/devices/system/cpu/cpu0/cache").exists():
        assert identity["last_level_cache"].startswith("L")


def test_capture_records_the_cpu_identity() -> None:
    env = capture(include_busy=False)
    assert env["cpu"] == cpu_identity() and env["cpu_model"]
