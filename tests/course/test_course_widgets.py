"""The notebooks' widget panels and deployment helpers, driven from Python as the widgets' callbacks drive them:
the router panel against a real pdlab router in front of stand-in servers (real processes, loopback, real load),
the simulator panel against the real simulator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdlab import course
from pdlab import model as local_models
from pdlab.config.base import ConfigError, load_yaml
from pdlab.config.sim import SimSpec
from pdlab.config.workload import MixedWorkload
from pdlab.course_widgets import RouterPanel, SimPanel, sim_table, sim_variant
from pdlab.settings import ADMIN_TOKEN_ENV, repo_root
from tests.router_processes import router, standin, url

PREFILL, DECODE, ROUTER = 20110, 20111, 20112
TOKEN = "course-widgets-test-token"


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


def test_router_panel_applies_settings_to_the_live_router_and_redraws(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PDLAB_RUNS", str(tmp_path / "runs"))
    model_dir = str(local_models.resolve("pdlab-tiny"))
    with standin(PREFILL, tmp_path, "--token-ms", "2"), standin(DECODE, tmp_path, "--token-ms", "2"), \
            router(ROUTER, tmp_path, model_dir, [PREFILL], [DECODE], env={ADMIN_TOKEN_ENV: TOKEN}, threshold=512):
        dep = RouterOnly(url(ROUTER), TOKEN, "pdlab-tiny", model_dir)
        workload = MixedWorkload(rate=8, duration_s=1.5, long_fraction=0.5, short_tokens=16, long_tokens=600,
                                 short_output_tokens=6, long_output_tokens=3, seed=1)
        panel = RouterPanel(dep, workload, lambda d, w: course.measure_load(d, w, progress=False),  # type: ignore[arg-type]
                            max_threshold=4096)
        assert panel.threshold.value == 512 and panel.figure.layout.title.text == "no run yet"

        panel.threshold.value = 4096  # what a slider release does: observe -> apply -> load -> redraw
        panel.decode_strategy.value = "leastloaded"
        live = httpx.get(url(ROUTER) + "/admin/config", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert live["threshold"] == 4096 and live["decode_strategy"] == "leastloaded"

        above, again = panel.history
        assert above.threshold == 4096 and above.disaggregated == 0 and above.direct > 0
        assert again.decode_strategy == "leastloaded"
        panel.threshold.value = 256
        below = panel.history[-1]
        assert below.disaggregated > 0, "600-token prompts must go prefill -> decode at threshold 256"
        assert list(panel.figure.data[0].x) == [4096, 4096, 256]
        assert panel.figure.layout.title.text.startswith("threshold 256:")
        assert "through prefill -> decode" in panel.status.value


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
    panel.prefill.value = 0
    assert "4 colocated" in panel.figure.layout.title.text
    assert panel.summary["paths"]["disaggregated"] == 0
    panel.rate.value = 5
    assert "5 req/s" in panel.figure.layout.title.text
    assert list(panel.figure.data[0].y) == list(sim_table({"now": panel.summary}).iloc[:4, 0])


def test_sim_panel_counts_gpus_per_instance_and_says_what_it_cannot_simulate(sim_spec: SimSpec) -> None:
    panel = SimPanel(sim_spec)
    assert panel.gpus.value == 2 and not panel.gpus.disabled
    panel.gpus.value = 8
    assert "x8 over nvlink4" in panel.summary["cost_model"]
    eight = list(panel.figure.data[0].y)
    panel.gpus.value = 1  # 70B in bf16 does not fit one H200's memory share
    assert "not simulated" in panel.status.value and "does not fit" in panel.status.value
    assert list(panel.figure.data[0].y) == eight  # the last figure stays
    panel.gpus.value = 4
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
