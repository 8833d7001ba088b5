"""The GPU tier against published measurements: setups from the P/D papers, each point simulated beside its figure.

A published setup (`labs/sim/published/*.yaml`) is a deployment the simulator can build (hardware, model, tensor
parallelism, token budget, optionally a profile) and the points its source measured on it, each with where the
figure comes from. A point is a batch of identical requests arriving together on one instance, and what was
measured of it:

- `prompt_ms`: the batch's prompt phase, from arrival to the last request's first token (batch 1: the TTFT);
- `token_ms`: the time between tokens while the batch decodes (the median gap);
- `prefill_step_ms` / `decode_step_ms`: one forward pass as a source's latency model gives it (a prefill of the
  batch's prompts; a decode step of the batch at the prompts' context), priced by the cost model directly.

`pdlab sim published` simulates every point and prints the error beside the published figure; docs/simulator.md
keeps the table. The sources are the authors' released data (their papers' figures are plots of it).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from pdlab.config.base import Spec, load_yaml
from pdlab.config.sim import SimEngine, SimSpec
from pdlab.model.catalog import Catalog, load_catalog
from pdlab.sim.costs import chunk_attention
from pdlab.sim.scenario import prepare, simulate
from pdlab.sim.summary import per_request_rows

Measure = Literal["prompt_ms", "token_ms", "prefill_step_ms", "decode_step_ms"]


class PublishedPoint(Spec):
    """One published figure: a batch of `batch` requests of `prompt_tokens` (and `output_tokens`) and what was
    measured of it."""

    measure: Measure
    prompt_tokens: int = Field(gt=0)
    batch: int = Field(default=1, gt=0)
    output_tokens: int = Field(default=16, gt=1)
    """Tokens each request asks for (the decode gaps measured are the first few; the published runs' own output
    length, where longer, changes the context by a few percent)."""
    published_ms: float = Field(gt=0)
    note: str = ""
    """What is odd about this figure, if anything (kept in the table, not fitted around)."""


class PublishedSetup(Spec):
    """A deployment from a paper and the figures its authors measured on it."""

    name: str
    source: str = Field(min_length=1)
    """The paper, and the file (repository, commit, path) the figures are read from."""
    setup: str = Field(min_length=1)
    """What ran: engine, GPUs, parallelism, as the source describes it."""
    hardware: str
    model: str
    engine: SimEngine = Field(default_factory=SimEngine)
    profile: Path | None = None
    points: list[PublishedPoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_kind_of_engine(self) -> PublishedSetup:
        if self.engine.max_num_batched_tokens < max((p.prompt_tokens * p.batch for p in self.points
                                                     if p.measure == "prompt_ms"), default=0):
            raise ValueError("engine.max_num_batched_tokens must hold a whole published prompt batch: the sources "
                             "prefilled each batch in one pass")
        return self


def load_setup(path: Path) -> PublishedSetup:
    return load_yaml(path, PublishedSetup)


def _spec(setup: PublishedSetup, point: PublishedPoint) -> SimSpec:
    requests = [{"at_s": 0.0, "prompt_tokens": point.prompt_tokens, "output_tokens": point.output_tokens}
                for _ in range(point.batch)]
    return SimSpec.model_validate({"name": setup.name, "hardware": setup.hardware, "model": setup.model,
                                   "profile": setup.profile, "pools": {"colocated": 1},
                                   "engine": setup.engine.model_dump(), "workload": {"requests": requests}})


def simulate_point(setup: PublishedSetup, point: PublishedPoint, catalog: Catalog) -> float:
    """What the simulator says `point` measures, ms."""
    spec = _spec(setup, point)
    if point.measure in ("prefill_step_ms", "decode_step_ms"):
        cost = prepare(spec, catalog).cost
        n, b = point.prompt_tokens, point.batch
        if point.measure == "prefill_step_ms":
            pairs = b * chunk_attention(n, 0)
            return cost.step_time(b * n, pairs, 0, 0, pairs, b * n * n / 2) * 1e3
        return cost.step_time(0, 0, b, b * n) * 1e3
    _, sim = simulate(spec, catalog=catalog)
    rows = per_request_rows(sim.requests)
    if point.measure == "prompt_ms":
        return max(row["ttft_s"] for row in rows) * 1e3
    return float(np.median(np.concatenate([row["itl_s"] for row in rows]))) * 1e3


def validate_setup(setup: PublishedSetup, catalog: Catalog | None = None) -> dict:
    """Every point simulated beside its published figure, and the errors' summary per measure and overall."""
    catalog = catalog or load_catalog()
    rows = []
    for point in setup.points:
        simulated = simulate_point(setup, point, catalog)
        rows.append({**point.model_dump(), "simulated_ms": simulated,
                     "error_pct": (simulated / point.published_ms - 1) * 100})
    # A figure with a note (one the source itself contradicts) is shown, not counted.
    counted = [r for r in rows if not r["note"]]
    by_measure = {measure: _summary([abs(r["error_pct"]) for r in counted if r["measure"] == measure])
                  for measure in dict.fromkeys(r["measure"] for r in counted)}
    return {"name": setup.name, "source": setup.source, "setup": setup.setup, "hardware": setup.hardware,
            "model": setup.model, "engine": setup.engine.model_dump(), "points": rows, "by_measure": by_measure,
            **_summary([abs(r["error_pct"]) for r in counted]), "not_counted": len(rows) - len(counted)}


def _summary(errors: list[float]) -> dict:
    return {"median_error_pct": statistics.median(errors), "max_error_pct": max(errors),
            "within_10pct": sum(e <= 10 for e in errors), "count": len(errors)}
