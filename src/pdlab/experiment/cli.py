"""`pdlab run` and `pdlab demo`."""

from __future__ import annotations
