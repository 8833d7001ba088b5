"""A lab spec (`labs/*.yaml`): one file that says what to deploy and, for experiments, what to measure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from pdlab.config.base import ConfigError, Spec, load_yaml, validate
from pdlab.config.cluster import ClusterSpec
from pdlab.config.deployment import DeploymentSpec
from pdlab.config.workload import WorkloadSpec


class SweepSpec(Spec):
    """Re-run one scenario's load at each value of a router setting, changed live through the admin API."""

    scenario: str | list[str]
    """The scenario (a deployment with a router) to sweep, or several, each swept the same way."""
    setting: Literal["threshold", "prefill_strategy", "decode_strategy"] = "threshold"
    """The router setting to vary."""
    values: list[int | str] = Field(min_length=1)
    """The values to measure, in order (tokens for `threshold`, strategy names for the others)."""

    @property
    def scenarios(self) -> list[str]:
        return [self.scenario] if isinstance(self.scenario, str) else list(self.scenario)

    @model_validator(mode="after")
    def _values_fit_the_setting(self) -> SweepSpec:
        from pdlab.config.router import RouterSettings

        for i, value in enumerate(self.values):
            try:
                RouterSettings.model_validate({self.setting: value})
            except ValueError as error:
                raise ValueError(f"values.{i}: {value!r} is not a valid {self.setting}: {error}") from None
        return self


class EventSpec(Spec):
    """Something that happens to a deployment while the load runs (failure drills)."""

    at_s: float = Field(ge=0)
    """Seconds after the scenario's load starts."""
    action: Literal["kill", "kill_leader", "restart"] = "kill"
    """`kill`: SIGKILL the instance's whole process group, as a crash would. `kill_leader`: SIGKILL only its
    leading process (vLLM's API server; the guard must then stop its engine). `restart`: stop the instance's
    process group (whatever is left of it) and start it again, as `pdlab restart` does."""
    instance: str
    """Name of the instance it happens to."""
    scenarios: list[str] = []
    """Scenarios it applies to (empty: all that have the instance)."""


class ExperimentSpec(Spec):
    """How `pdlab run` measures a lab's scenarios."""

    baseline_scenario: str | None = None
    """Also run the short requests alone (long prompts left out of the same schedule) on this scenario's
    deployment: the `baseline` the others are compared with."""
    stall_k: float = Field(default=5.0, gt=1)
    """A gap longer than `stall_k` x the request's median gap is a stall."""
    sweep: SweepSpec | None = None
    """Measure one scenario at several router thresholds."""
    events: list[EventSpec] = []
    """Failure drills during the load."""
    quick_duration_s: float = Field(default=20.0, gt=0)
    """Load duration used by `--quick` runs (tests, notebooks in CI)."""
    quick_requests: int | None = Field(default=None, ge=1)
    """Instead of `quick_duration_s`: `--quick` runs send the schedule's first this many main-load requests,
    however long they take to arrive. With a load sized to the machine (`prefill_load`), every machine then sends
    the same requests in the same pattern; a duration would cut it where the measured rate puts the end, a few
    requests more or less from one run to the next."""
    demo_scenarios: list[str] = []
    """The scenarios `pdlab demo` runs of this lab (the demo lab's headline; `pdlab run` runs them all). Empty:
    all."""

    @model_validator(mode="after")
    def _quick_requests_without_events(self) -> ExperimentSpec:
        if self.quick_requests is not None and self.events:
            raise ValueError("`quick_requests` cannot cut a lab with `events`: their times are in seconds, so a quick "
                             "run scales them to `quick_duration_s`; give that instead")
        return self


#: The point of the short requests measured alone, on the baseline scenario's deployment.
BASELINE = "baseline"


@dataclass(frozen=True)
class LabPoint:
    """One thing `pdlab run` measures (and `pdlab sim lab` simulates): a scenario, one value of a sweep
    (`scenario@value`) or the baseline."""

    name: str
    """What the run directory and the summary call it."""
    scenario: str
    """The scenario whose deployment it runs on."""
    router: dict[str, int | str] = field(default_factory=dict)
    """The router setting it is measured at, changed live (a sweep's value); empty: as the router runs."""
    baseline: bool = False
    """The short requests alone (the long ones left out of the same schedule)."""


class LabSpec(Spec):
    """A lab: a deployment to bring up, or several scenarios to compare under one workload."""

    name: str
    """Lab name (used for run directories)."""
    description: str = ""
    """What the lab shows, in a sentence or two."""
    deployment: DeploymentSpec | None = None
    """The deployment `pdlab up` brings up."""
    scenarios: dict[str, DeploymentSpec] = {}
    """Named deployments an experiment compares on the same cores."""
    workload: WorkloadSpec | None = None
    """The load an experiment sends."""
    seed: int = 0
    """Seed for everything random in the lab."""
    cluster: ClusterSpec | None = None
    """Cluster-tier settings (pdlab.cluster)."""
    experiment: ExperimentSpec = Field(default_factory=ExperimentSpec)
    """How `pdlab run` measures the scenarios."""

    @model_validator(mode="after")
    def _has_deployment(self) -> LabSpec:
        if self.deployment is None and not self.scenarios:
            raise ValueError("a lab needs a `deployment` or at least one entry in `scenarios`")
        return self

    @model_validator(mode="after")
    def _experiment_names_exist(self) -> LabSpec:
        exp = self.experiment
        if exp.baseline_scenario is not None and exp.baseline_scenario not in self.scenarios:
            raise ValueError(f"experiment.baseline_scenario: {exp.baseline_scenario!r} is not one of the "
                             f"scenarios {sorted(self.scenarios)}")
        for name in exp.sweep.scenarios if exp.sweep is not None else []:
            swept = self.scenarios.get(name)
            if swept is None:
                raise ValueError(f"experiment.sweep.scenario: {name!r} is not one of the "
                                 f"scenarios {sorted(self.scenarios)}")
            if swept.router is None:
                raise ValueError(f"experiment.sweep.scenario: the swept scenario {name!r} needs a `router`")
        for name in exp.demo_scenarios:
            if name not in self.scenarios:
                raise ValueError(f"experiment.demo_scenarios: {name!r} is not one of the scenarios "
                                 f"{sorted(self.scenarios)}")
        for i, event in enumerate(exp.events):
            names = {inst.name for spec in self.scenarios.values() for inst in spec.instances}
            if event.instance not in names:
                raise ValueError(f"experiment.events.{i}.instance: no scenario has an instance {event.instance!r}")
        return self

    def points(self, only: Sequence[str] = ()) -> list[LabPoint]:
        """Every point an experiment measures, in the order it measures them: each scenario (or, for a swept one,
        each value of the sweep), and the baseline right after its scenario; `only` keeps those scenarios'."""
        unknown = sorted(set(only) - set(self.scenarios))
        if unknown:
            raise ValueError(f"no scenario(s) {unknown} in lab {self.name!r}; it has {sorted(self.scenarios)}")
        sweep = self.experiment.sweep
        points = []
        for name in self.scenarios:
            if only and name not in only:
                continue
            if sweep is not None and name in sweep.scenarios:
                points += [LabPoint(f"{name}@{value}", name, {sweep.setting: value}) for value in sweep.values]
            else:
                points.append(LabPoint(name, name))
            if self.experiment.baseline_scenario == name:
                points.append(LabPoint(BASELINE, name, baseline=True))
        return points

    def main_deployment(self) -> DeploymentSpec:
        """The deployment `pdlab up` starts: `deployment`, else the first scenario."""
        if self.deployment is not None:
            return self.deployment
        return next(iter(self.scenarios.values()))


def load_lab(path: str | Path) -> LabSpec:
    """Load and validate a lab spec; errors name the file and each bad field."""
    return load_yaml(path, LabSpec)


def parse_lab(text: str, source: str = "lab spec") -> LabSpec:
    """Validate a lab spec written as YAML text (a notebook cell, a string); errors name `source` and each bad
    field, as for a file."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(source, [("(yaml)", str(error))]) from None
    return validate(LabSpec, {} if data is None else data, source=source)
