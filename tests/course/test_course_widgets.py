"""The notebooks' widget panels and deployment helpers, driven from Python as the widgets' callbacks drive them:
the router panel against a real pdlab router in front of stand-in servers (real processes, loopback, real load),
the simulator panel against the real simulator."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdlab import course
from pdlab import model as local_models
from pdlab.config.base import ConfigError, load_yaml
from pdlab.config.sim import SimSpec
from pdlab.config.workload import MixedWorkload, TraceWorkload
from pdlab.course_widgets import RouterPanel, SimPanel, StrategyPanel, sim_table, sim_variant
from pdlab.settings import ADMIN_TOKEN_ENV, repo_root
from tests.router_processes import router, standin, url

PREFILL, DECODE, ROUTER = 20110, 20111, 20112
TOKEN = "course-widgets-test-token"


@dataclass
class Instance:
    url: str


@dataclass
class RouterOnly:
    """What the panel and `course.measure_load` use of a Deployment, for a router over stand-in servers."""

    router_url: str
    admin_token: str
    served_model: str
    model_dir: str

    @property
    def url(self) -> str:
        return self.router_url


@dataclass
class Replicas(RouterOnly):
    """A router over stand-in replicas, with their instances (the strategy panel reads their counters)."""

    instances: list[Instance]


def measure(dep, workload, **controls):  # type: ignore[no-untyped-def]
    return course.measure_load(dep, workload, progress=False, **controls)


@contextmanager
def pd_over_standins(tmp_path: Path, token_ms: int) -> Iterator[RouterOnly]:
    """A router (threshold 512) over a stand-in prefill and decode server, each answering a token per `token_ms`."""
    model_dir, pace = str(local_models.resolve("pdlab-tiny")), str(token_ms)
    with standin(PREFILL, tmp_path, "--token-ms", pace), standin(DECODE, tmp_path, "--token-ms", pace), \
            router(ROUTER, tmp_path, model_dir, [PREFILL], [DECODE], env={ADMIN_TOKEN_ENV: TOKEN}, threshold=512):
        yield RouterOnly(url(ROUTER), TOKEN, "pdlab-tiny", model_dir)


def router_panel(dep: RouterOnly, **load: float) -> RouterPanel:
    """The threshold panel over `dep`, its load short prompts of 16 tokens and long ones of 600."""
    workload = MixedWorkload(short_tokens=16, long_tokens=600, long_output_tokens=3, seed=1, **load)
    return RouterPanel(dep, workload, measure, max_threshold=4096)  # type: ignore[arg-type]


def test_router_panel_applies_settings_to_the_live_router_and_redraws(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PDLAB_RUNS", str(tmp_path / "runs"))
    with pd_over_standins(tmp_path, token_ms=2) as dep:
        panel = router_panel(dep, rate=8, duration_s=1.5, long_fraction=0.5, short_output_tokens=6)
        assert panel.threshold.value == 512 and panel.figure.layout.title.text == "no run yet"

        panel.threshold.value = 4096  # what a slider release does: observe -> apply -> load -> redraw, off-thread
        above = panel.wait(60)
        live = httpx.get(url(ROUTER) + "/admin/config", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert live["threshold"] == 4096
        assert above.threshold == 4096 and above.disaggregated == 0 and above.direct > 0
        panel.threshold.value = 256
        below = panel.wait(60)
        assert below.disaggregated > 0, "600-token prompts must go prefill -> decode at threshold 256"
        assert [list(trace.x) for trace in panel.figure.data] == [[4096, 256], [4096, 256]]
        assert panel.figure.layout.title.text.startswith("threshold 256:")
        assert "through prefill -> decode" in panel.status.value
        assert panel.runs.progress.description == "done" and panel.runs.cancel.disabled

        # Another load is another series: its points are not drawn as if the threshold had made them.
        panel.rate.value = 4
        panel.wait(60)
        assert [trace.name for trace in panel.figure.data] == ["8 req/s, 50% long"] * 2 + ["4 req/s, 50% long"] * 2
        assert list(panel.figure.data[2].x) == [256]


def test_a_panel_run_can_be_cancelled_and_its_numbers_are_dropped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PDLAB_RUNS", str(tmp_path / "runs"))
    with pd_over_standins(tmp_path, token_ms=20) as dep:
        panel = router_panel(dep, rate=4, duration_s=30, long_fraction=0.2, short_output_tokens=50)
        panel.threshold.value = 1024
        deadline = time.monotonic() + 30
        while panel.runs.progress.value == 0 and time.monotonic() < deadline:  # some requests are back
            time.sleep(0.2)
        assert 0 < panel.runs.progress.value < 1 and not panel.runs.cancel.disabled
        started = time.monotonic()
        panel.runs.cancel.click()
        panel.runs.wait(30)
        assert time.monotonic() - started < 25, "Cancel must stop the 30 s load, not wait for its end"
        assert panel.history == [] and panel.runs.progress.description == "cancelled"


def test_strategy_panel_applies_the_strategy_and_puts_strategies_on_their_own_axis(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setenv("PDLAB_RUNS", str(tmp_path / "runs"))
    model_dir = str(local_models.resolve("pdlab-tiny"))
    a, b = DECODE, PREFILL
    with standin(a, tmp_path, "--token-ms", "2"), standin(b, tmp_path, "--token-ms", "2"), \
            router(ROUTER, tmp_path, model_dir, [], [a, b], env={ADMIN_TOKEN_ENV: TOKEN}, threshold=100000):
        dep = Replicas(url(ROUTER), TOKEN, "pdlab-tiny", model_dir, [Instance(url(a)), Instance(url(b))])
        workload = TraceWorkload(path="data/traces/shared-prefix.jsonl", length_scale=0.1, time_scale=0.2,
                                 max_output_tokens=4, long_threshold_tokens=100000, duration_s=3)
        panel = StrategyPanel(dep, workload, measure)  # type: ignore[arg-type]
        panel.strategy.value = "prefixaware"
        run = panel.wait(60)
        live = httpx.get(url(ROUTER) + "/admin/config", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert live["decode_strategy"] == "prefixaware" and run.strategy == "prefixaware" and run.requests > 0
        panel.strategy.value = "roundrobin"
        panel.wait(60)
        assert list(panel.figure.data[1].x) == ["prefixaware", "roundrobin"]
        assert panel.figure.layout.xaxis.type == "category"
        assert panel.figure.layout.title.text.startswith("roundrobin:")


def test_router_panel_needs_a_router() -> None:
    dep = RouterOnly("", "", "pdlab-tiny", "")
    dep.router_url = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="needs a deployment with a router"):
        RouterPanel(dep, MixedWorkload(duration_s=1), lambda d, w: None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sim_spec() -> SimSpec:
    spec = load_yaml(repo_root() / "labs" / "sim" / "llama70b-h200-efa.yaml", SimSpec)
    poisson = spec.workload.poisson.model_copy(update={"num_requests": 300})
    return spec.model_copy(update={"workload": spec.workload.model_copy(update={"poisson": poisson})})


def test_sim_panel_resimulates_on_every_change(sim_spec: SimSpec) -> None:
    panel = SimPanel(sim_spec)
    assert "4P4D" in panel.figure.layout.title.text and panel.summary["paths"]["disaggregated"] > 0
    first = list(panel.figure.data[2].y)
    panel.prefill.value = 0
    panel.wait(60)
    assert "4 colocated" in panel.figure.layout.title.text
    assert panel.summary["paths"]["disaggregated"] == 0
    assert list(panel.figure.data[0].y) == first  # the setting before the change, beside the new one
    panel.rate.value = 5
    panel.wait(60)
    assert "5 req/s" in panel.figure.layout.title.text
    assert list(panel.figure.data[2].y) == list(sim_table({"now": panel.summary}).iloc[:4, 0])
    assert panel.figure.data[3].y[0] == pytest.approx(100 * panel.summary["goodput"]["attainment"])


def test_sim_panel_strategy_moves_prefix_hits_on_the_cluster_scenario() -> None:
    spec = load_yaml(repo_root() / "labs" / "sim" / "llama8b-h200-shared-prefix.yaml", SimSpec)
    trace = spec.workload.trace.model_copy(update={"num_requests": 800})
    panel = SimPanel(spec.model_copy(update={"workload": spec.workload.model_copy(update={"trace": trace})}))
    assert abs(panel.rate.value - 80) <= 2 and panel.decode_strategy.value == "roundrobin"
    spread = panel.summary["prefix_cache"]["hit_rate"]
    panel.decode_strategy.value = "prefixaware"
    panel.wait(60)
    kept = panel.summary["prefix_cache"]["hit_rate"]
    assert kept > spread + 0.2, (spread, kept)
    assert panel.figure.data[1].y[1] == pytest.approx(100 * spread) and panel.figure.data[3].y[1] == pytest.approx(
        100 * kept)
    assert "roundrobin" in panel.status.value and "prefixaware" in panel.status.value


def test_sim_panel_counts_gpus_per_instance_and_says_what_it_cannot_simulate(sim_spec: SimSpec) -> None:
    panel = SimPanel(sim_spec)
    assert panel.gpus.value == 2 and not panel.gpus.disabled
    panel.gpus.value = 8
    panel.wait(60)
    assert "x8 over nvlink4" in panel.summary["cost_model"]
    eight = list(panel.figure.data[2].y)
    panel.gpus.value = 1  # 70B in bf16 does not fit one H200's memory share
    panel.wait(60)
    assert "not simulated" in panel.status.value and "does not fit" in panel.status.value
    assert list(panel.figure.data[2].y) == eight  # the last figure stays
    panel.gpus.value = 4
    panel.wait(60)
    assert "not simulated" not in panel.status.value and "x4 over nvlink4" in panel.summary["cost_model"]


def test_sim_variant_drops_the_old_links_figures_with_its_name(sim_spec: SimSpec) -> None:
    given = sim_spec.model_copy(update={"link": sim_spec.link.model_copy(update={"bandwidth_gbps": 123.0})})
    assert sim_variant(given, threshold=0, prefill=1, decode=1, rate=1, link="tcp-10gbe").link.bandwidth_gbps is None
    assert sim_variant(given, threshold=0, prefill=1, decode=1, rate=1, link="efa-p5en").link.bandwidth_gbps == 123.0
    wide = sim_variant(sim_spec, threshold=0, prefill=1, decode=1, rate=1, link="efa-p5en", tensor_parallel=8)
    assert wide.engine.tensor_parallel == 8


def test_sim_variant_sets_pools_rate_link_threshold(sim_spec: SimSpec) -> None:
    spec = sim_variant(sim_spec, threshold=100, prefill=1, decode=3, rate=7.0, link="tcp-10gbe")
    assert (spec.pools.prefill, spec.pools.decode, spec.pools.colocated) == (1, 3, 0)
    assert spec.workload.poisson.rate_rps == 7.0 and spec.link.name == "tcp-10gbe" and spec.router.threshold == 100
    assert sim_variant(sim_spec, threshold=0, prefill=0, decode=4, rate=1, link="efa-p5").pools.colocated == 4


def test_lab_deployment_swaps_the_model() -> None:
    spec = course.lab_deployment("local-1p1d-router", "pdlab-tiny")
    assert spec.model.name == "pdlab-tiny" and spec.router is not None and spec.router.threshold == 512
    assert [i.role for i in spec.instances] == ["prefill", "decode"]
    with pytest.raises(ConfigError, match="no such file"):
        course.lab_deployment("no-such-lab")


def test_attached_is_none_unless_a_named_deployment_is_up(monkeypatch) -> None:
    monkeypatch.delenv(course.ATTACH_ENV, raising=False)
    assert course.attached() is None
    monkeypatch.setenv(course.ATTACH_ENV, "no-such-deployment-up")
    assert course.attached() is None
