"""What a simulated figure is worth: the profile's validated error on the nearest validated setup, or "not
validated" where no measurement covers the setup.

Every simulated number pdlab prints comes with one line from here. The validations are the recorded ones:
- the local tier (a fitted CPU profile): `pdlab sim validate` of the profile's own calibration sitting
  (data/results/sim-validation/), and, for a profile `pdlab sim probe` fitted, the probe procedure's validations on
  the machines it was checked on (data/results/sim-probe/*/validation.json);
- the GPU tier: `pdlab sim published` against the P/D papers' measurements (data/results/sim-published/): the
  setup of the same accelerator, model and tensor parallelism, else the nearest one (same accelerator first), shown
  as not covering this one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pdlab.config.sim import SimSpec
from pdlab.model.catalog import load_catalog
from pdlab.settings import data_dir


@dataclass(frozen=True)
class Worth:
    """One line to print under a simulated figure, and what it rests on."""

    validated: bool
    """Whether a recorded validation covers this setup (its kind of machine, accelerator, model)."""
    text: str
    median_error_pct: float | None = None
    within_10pct: str | None = None
    """`n/m` metrics (or points) within 10%."""
    record: str | None = None
    """The validation record the figures come from."""


def _results() -> Path:
    return data_dir() / "results"


@lru_cache(maxsize=8)
def _json(path: Path, mtime: float) -> dict:
    return json.loads(path.read_text())


def _read(path: Path) -> dict:
    return _json(path, path.stat().st_mtime)


def _relative(path: Path) -> str:
    return str(path.relative_to(data_dir().parent))


def local_worth(profile_path: Path) -> Worth:
    """A fitted CPU profile's validated error: a probed machine's profile, by the probe procedure's validations;
    another, by the newest validation of that profile's own sitting (matched by name)."""
    from pdlab.sim.scenario import same_machine

    profile = _read(profile_path)
    here = "" if same_machine(profile.get("environment")) else (
        "; fitted on another machine than this one (`pdlab sim probe` fits this one's in about three minutes)")
    if "machine" in profile:
        records = sorted((_results() / "sim-probe").glob("*/validation.json"))
        if not records:
            return Worth(False, "this machine's profile (`pdlab sim probe`): the probe procedure is not validated "
                                "yet" + here)
        last = records[-1]
        found = _read(last)
        cpu = found.get("machine_label") or (found.get("environment") or {}).get("cpu_model", "another machine")
        return Worth(True, f"a probed profile's validated error (demo lab on {cpu}): median "
                           f"{found['median_error_pct']:.1f}%, {found['within_goal']}/{found['metrics']} metrics "
                           f"within 10% ({_relative(last)})" + here,
                     found["median_error_pct"], f"{found['within_goal']}/{found['metrics']}", _relative(last))
    if not here:
        here = ("; machines of one kind run up to twice as fast or slow from one day to the next: `pdlab sim probe` "
                "fits this one today")
    name = profile_path.stem
    records = [path for path in sorted((_results() / "sim-validation").glob("*.json"))
               if Path(str(_read(path).get("profile", ""))).stem == name]
    if not records:
        return Worth(False, f"{name}: not validated" + here)
    last = records[-1]
    found = _read(last)
    return Worth(True, f"{name}'s validated error on its calibration machine: median {found['median_error_pct']:.1f}%, "
                       f"{found['within_goal']}/{found['metrics']} metrics within 10% ({_relative(last)})" + here,
                 found["median_error_pct"], f"{found['within_goal']}/{found['metrics']}", _relative(last))


def gpu_worth(hardware: str, model: str, tensor_parallel: int) -> Worth:
    """The GPU tier's error against the published setup of this accelerator, model and tensor parallelism; where
    none is, "not validated", with the nearest setup's error beside it."""
    records = sorted((_results() / "sim-published").glob("*.json"))
    if not records:
        return Worth(False, f"not validated: no published measurement recorded ({hardware}, {model})")
    setups = _read(records[-1])["setups"]
    catalog = load_catalog()

    def distance(setup: dict) -> float:
        """How far a published setup is from this one in the roofline's own terms: the accelerators' peak compute
        and bandwidth, the models' weights, the tensor parallelism (log ratios, summed)."""
        ours, theirs = catalog.get("hardware", hardware), catalog.get("hardware", setup["hardware"])
        return (abs(math.log(ours.peak_bf16_tflops / theirs.peak_bf16_tflops))
                + abs(math.log(ours.hbm_gbps / theirs.hbm_gbps))
                + abs(math.log(catalog.get("models", model).params / catalog.get("models", setup["model"]).params))
                + abs(math.log(tensor_parallel / int(setup["engine"]["tensor_parallel"]))))

    best = min(setups, key=distance)
    figures = (f"median {best['median_error_pct']:.0f}%, {best['within_10pct']}/{best['count']} points within 10% "
               f"({_relative(records[-1])})")
    covered = (best["hardware"], best["model"], int(best["engine"]["tensor_parallel"])) == (
        hardware, model, tensor_parallel)
    if covered:
        return Worth(True, f"validated against {best['name']}: {figures}", best["median_error_pct"],
                     f"{best['within_10pct']}/{best['count']}", _relative(records[-1]))
    return Worth(False, f"not validated on {hardware} with {model} at tensor parallel {tensor_parallel}; nearest "
                        f"published setup {best['name']} ({best['hardware']}, {best['model']}, TP "
                        f"{best['engine']['tensor_parallel']}): {figures}",
                 record=_relative(records[-1]))


def worth(spec: SimSpec) -> Worth:
    """What `spec`'s simulated figures are worth (see the module's docstring)."""
    from pdlab.sim.scenario import resolve_profile

    if spec.profile is not None:
        path = resolve_profile(spec.profile)
        profile = _read(path)
        if profile.get("gpu") in (None, "cpu"):
            return local_worth(path)
        tp = int(profile.get("tensor_parallel", spec.engine.tensor_parallel))
        return gpu_worth(spec.hardware, spec.model, tp)
    return gpu_worth(spec.hardware, spec.model, spec.engine.tensor_parallel)
