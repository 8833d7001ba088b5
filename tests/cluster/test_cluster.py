"""The cluster tier's specs, renders and CLI: every shipped cluster lab renders for every target, matches its golden
files byte for byte, parses back to what the spec said, and bad specs fail naming the field."""

from __future__ import annotations

import copy
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdlab.cluster import k8s
from pdlab.cluster.plan import HYPERPOD_STRATEGY, plan
from pdlab.cluster.render import TARGETS, render
from pdlab.config import ConfigError, LabSpec, validate
from pdlab.config.router import Strategy

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "cluster"
CLUSTER_LABS = sorted((ROOT / "labs").glob("hyperpod-*.yaml"))
LAB_IDS = [lab.stem for lab in CLUSTER_LABS]
#: The spec the bad-spec tests break one field of.
BASE_LAB = ROOT / "labs" / "hyperpod-llama8b-1p1d.yaml"


def raw(lab: Path) -> dict:
    return yaml.safe_load(lab.read_text())


def plan_of(data: dict, source: str = "spec"):
    return plan(validate(LabSpec, data, source=source), source=source)


def problems_of(data: dict, target: str | None = None) -> dict[str, str]:
    """Field -> message of the ConfigError a bad spec raises (validation, cross-field check or render)."""
    with pytest.raises(ConfigError) as caught:
        p = plan_of(data)
        if target:
            render(p, target)
    problems = dict(caught.value.problems)
    # pydantic model validators report at the model's path with the field named first in the message.
    for where, why in list(problems.items()):
        head = why.removeprefix("Value error, ").split(":", 1)[0]
        if " " not in head:
            problems[f"{where}.{head}"] = why
    return problems


def test_shipped_cluster_labs_exist():
    assert {"hyperpod-llama8b-1p1d", "hyperpod-llama70b-2p2d"} <= set(LAB_IDS)


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
@pytest.mark.parametrize("target", TARGETS)
def test_render_matches_golden(lab: Path, target: str):
    p = plan_of(raw(lab), str(lab.relative_to(ROOT)))
    files = render(p, target, source=str(lab.relative_to(ROOT)))
    golden_dir = GOLDEN / p.lab.name / target
    golden = {path.name: path.read_text() for path in golden_dir.iterdir()}
    assert sorted(files) == sorted(golden), "regenerate with tests/cluster/regen_golden.py and review the diff"
    for name, text in files.items():
        assert text == golden[name], f"{name} differs from {golden_dir / name}; regenerate and review"


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
def test_k8s_round_trip(lab: Path):
    """spec -> render -> parse gives back what the spec said."""
    data = raw(lab)
    p = plan_of(data)
    docs = {name: list(yaml.safe_load_all(text)) for name, text in render(p, "k8s").items()}
    for role in ("prefill", "decode"):
        service, statefulset = docs[f"{role}.yaml"]
        pool = data["cluster"][role]
        assert statefulset["kind"] == "StatefulSet" and service["kind"] == "Service"
        assert service["spec"]["clusterIP"] == "None"
        assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
        assert statefulset["spec"]["replicas"] == pool["replicas"]
        assert statefulset["metadata"]["namespace"] == data["cluster"]["namespace"]
        container = statefulset["spec"]["template"]["spec"]["containers"][0]
        assert container["args"][0] == data["deployment"]["model"]["name"]
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == str(pool.get("tensor_parallel_size", pool["gpus"]))
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(pool["gpus"])
        assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == str(pool["efa_interfaces"])
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["PYTHONHASHSEED"] == "0"
        assert statefulset["spec"]["template"]["spec"].get("nodeSelector", {}) == pool.get("node_selector", {})
        assert service["spec"]["selector"] == statefulset["spec"]["template"]["metadata"]["labels"]
    lmcache = {name: yaml.safe_load(text) for name, text in docs["lmcache-config.yaml"][0]["data"].items()}
    assert lmcache["lmcache-prefill.yaml"]["pd_role"] == "sender"
    assert lmcache["lmcache-decode.yaml"]["pd_role"] == "receiver"
    assert {c["nixl_backends"][0] for c in lmcache.values()} == set(data["deployment"]["connector"]["nixl_backends"])
    router_dep, router_svc = docs["router.yaml"]
    router = router_options(router_dep["spec"]["template"]["spec"]["containers"][0]["command"])
    assert_router_matches(router, data)
    namespace = data["cluster"]["namespace"]
    for role in ("prefill", "decode"):
        name = f"{data['cluster']['endpoint_name']}-{role}"
        assert router[role] == [f"http://{name}-{i}.{name}.{namespace}.svc.cluster.local:8000"
                                for i in range(data["cluster"][role]["replicas"])]
    assert router_svc["spec"]["selector"] == router_dep["spec"]["template"]["metadata"]["labels"]


def router_options(argv: list[str]) -> dict[str, list[str]]:
    """`pdlab router serve` options by name (repeated ones collected)."""
    assert argv[:3] == ["pdlab", "router", "serve"]
    out: dict[str, list[str]] = {}
    for flag, value in zip(argv[3::2], argv[4::2], strict=True):
        out.setdefault(flag.removeprefix("--"), []).append(value)
    return out


def assert_router_matches(router: dict[str, list[str]], data: dict) -> None:
    """The rendered options carry the lab's router settings (an option left out is at RouterSpec's default)."""
    from pdlab.config.router import RouterSpec

    spec, default = data["deployment"]["router"], RouterSpec()
    assert router.get("threshold", [str(default.threshold)]) == [str(spec["threshold"])]
    assert router.get("prefill-strategy", [default.prefill_strategy]) == [spec["prefill_strategy"]]
    assert router.get("decode-strategy", [default.decode_strategy]) == [spec["decode_strategy"]]
    assert router["model"] == [data["deployment"]["model"]["name"]]
    assert len(router["prefill"]) == data["cluster"]["prefill"]["replicas"]
    assert len(router["decode"]) == data["cluster"]["decode"]["replicas"]


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
def test_hyperpod_round_trip(lab: Path):
    data = raw(lab)
    obj = yaml.safe_load(render(plan_of(data), "hyperpod")["inferenceendpointconfig.yaml"])
    spec = obj["spec"]
    assert spec["instanceType"] == data["cluster"]["instance_type"]
    assert spec["pdSpec"]["routingThreshold"] == data["deployment"]["router"]["threshold"]
    assert spec["intelligentRoutingSpec"]["routingStrategy"] == data["deployment"]["router"]["decode_strategy"]
    for role, key in (("prefill", "prefillSpec"), ("decode", "decodingSpec")):
        assert spec["pdSpec"][key]["replicas"] == data["cluster"][role]["replicas"]
        assert spec["pdSpec"][key]["resources"]["limits"]["vpc.amazonaws.com/efa"] == str(
            data["cluster"][role]["efa_interfaces"])
    assert spec["modelSourceConfig"]["huggingFaceModel"]["modelId"] == data["deployment"]["model"]["name"]


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
def test_script_round_trip(lab: Path):
    data = raw(lab)
    files = render(plan_of(data), "script")
    for role in ("prefill", "decode"):
        argv = exec_argv(files[f"{role}.sh"])
        assert argv[:3] == ["vllm", "serve", data["deployment"]["model"]["name"]]
        assert yaml.safe_load(files[f"lmcache-{role}.yaml"])["pd_role"] == ("sender" if role == "prefill" else
                                                                            "receiver")
    assert_router_matches(router_options(exec_argv(files["router.sh"])), data)


def exec_argv(script: str) -> list[str]:
    """The argv of a rendered script's `exec` line (continuation lines joined)."""
    body = script.split("\nexec ", 1)[1].replace("\\\n", " ")
    return shlex.split(body)


def test_scripts_are_valid_bash(tmp_path: Path):
    files = render(plan_of(raw(BASE_LAB)), "script")
    for name, text in files.items():
        if name.endswith(".sh"):
            (tmp_path / name).write_text(text)
            result = subprocess.run(["bash", "-n", str(tmp_path / name)], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr


# --- bad specs name the field -------------------------------------------------------------------------------------

def _with(path: str, value):
    data = copy.deepcopy(raw(BASE_LAB))
    node = data
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("deployment.router.threshold", -1, "deployment.router.threshold"),
        ("cluster.decode.replicas", 0, "cluster.decode.replicas"),
        ("cluster.prefill.replicas", 0, "cluster.prefill.replicas"),
        ("cluster.decode.model", "meta-llama/Llama-3.1-70B-Instruct", "cluster.decode.model"),
        ("cluster.prefill.gpus", 16, "cluster.prefill.gpus"),
        ("cluster.decode.efa_interfaces", 64, "cluster.decode.efa_interfaces"),
        ("cluster.decode.efa_interfaces", 0, "cluster.decode.efa_interfaces"),
        ("cluster.prefill.tensor_parallel_size", 3, "cluster.prefill.tensor_parallel_size"),
        ("cluster.decode.gpus", 2, "cluster.decode.tensor_parallel_size"),
        ("deployment.router.kv_protocol", "nixl", "deployment.router.kv_protocol"),
        ("cluster.instance_type", "ml.g5.xlarge", "cluster.instance_type"),
        ("cluster.endpoint_name", "Llama_8B", "cluster.endpoint_name"),
        ("deployment.connector.lmcache.peer_alloc_port", 7301, "deployment.connector.lmcache.peer_alloc_port"),
        ("cluster.model_source.kind", "s3", "cluster.model_source.s3_bucket"),
        ("cluster.prefil", {"replicas": 1}, "cluster.prefil"),
        ("deployment.connector.kind", "nixl", "deployment.connector.kind"),
        ("deployment.connector.buffer_device", "cpu", "deployment.connector.buffer_device"),
        ("deployment.model.name", "pdlab-small", "deployment.model.name"),
        ("deployment.router", _DELETE, "deployment.router"),
        ("deployment.instances.1.role", "prefill", "deployment.instances"),
        ("cluster", _DELETE, "cluster"),
    ],
)
def test_bad_spec_names_the_field(path, value, field):
    problems = problems_of(_with(path, value))
    assert field in problems, problems


def test_strategy_without_hyperpod_equivalent_names_the_field():
    data = _with("deployment.router.decode_strategy", "leastloaded")
    data["deployment"]["router"]["prefill_strategy"] = "leastloaded"
    problems = problems_of(data, target="hyperpod")
    assert "leastloaded" in problems["deployment.router.decode_strategy"]
    # The same spec is fine where the pdlab router routes (k8s, script).
    assert render(plan_of(data), "k8s")


def test_per_pool_strategies_need_one_hyperpod_strategy():
    data = _with("deployment.router.prefill_strategy", "roundrobin")
    assert "deployment.router.prefill_strategy" in problems_of(data, target="hyperpod")


def test_every_pdlab_strategy_is_mapped():
    assert set(HYPERPOD_STRATEGY) == set(Strategy.__args__)
    assert [name for name, hp in HYPERPOD_STRATEGY.items() if hp is None] == ["leastloaded"]


def test_s3_source_renders_for_hyperpod_only():
    data = _with("cluster.model_source", {"kind": "s3", "s3_bucket": "models", "region": "us-west-2",
                                          "location": "llama-3.1-8b/"})
    obj = yaml.safe_load(render(plan_of(data), "hyperpod")["inferenceendpointconfig.yaml"])
    assert obj["spec"]["modelSourceConfig"] == {"modelSourceType": "s3", "modelLocation": "llama-3.1-8b/",
                                                "s3Storage": {"bucketName": "models", "region": "us-west-2"}}
    assert "cluster.model_source.kind" in problems_of(data, target="k8s")


def test_decode_ports_follow_tensor_parallel_ranks():
    p = plan_of(raw(ROOT / "labs" / "hyperpod-llama70b-2p2d.yaml"))
    assert p.decode.lmcache["pd_peer_init_port"] == list(range(7300, 7308))
    ports = {port["containerPort"] for port in k8s.statefulset(p, p.decode)["spec"]["template"]["spec"]
             ["containers"][0]["ports"]}
    assert set(range(7300, 7308)) | set(range(7400, 7408)) | {8000} == ports


# --- CLI ----------------------------------------------------------------------------------------------------------

def pdlab(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-c", "from pdlab.cli import main; main()", *args],
                          capture_output=True, text=True, env=full_env, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("target", TARGETS)
def test_cli_render_writes_the_golden_files(tmp_path: Path, target: str):
    lab = BASE_LAB
    result = pdlab("cluster", "render", str(lab.relative_to(ROOT)), "--target", target, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    golden_dir = GOLDEN / raw(lab)["name"] / target
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in golden_dir.iterdir())
    for path in golden_dir.iterdir():
        assert (tmp_path / path.name).read_text() == path.read_text()
    if target == "script":
        assert os.access(tmp_path / "prefill.sh", os.X_OK)


def test_cli_bad_spec_exits_with_the_field(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with("cluster.decode.replicas", 0)))
    result = pdlab("cluster", "render", str(bad), "--target", "k8s", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "cluster.decode.replicas" in result.stderr
    assert not (tmp_path / "out").exists()


def test_cli_dry_run_prints_kubectl_command(tmp_path: Path):
    result = pdlab("cluster", "apply", str(BASE_LAB), "--target", "k8s", "--out", str(tmp_path), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"kubectl apply -f {tmp_path}" in result.stdout
    assert (tmp_path / "decode.yaml").exists()
    result = pdlab("cluster", "status", str(BASE_LAB), "--target", "hyperpod", "--out", str(tmp_path),
                   "--dry-run")
    assert "kubectl get inferenceendpointconfigs" in result.stdout


def test_cli_without_kubectl_says_how_to_get_it(tmp_path: Path):
    # A PATH with no kubectl on it: pdlab must say what is missing and how to install it.
    result = pdlab("cluster", "delete", str(BASE_LAB), "--out", str(tmp_path), env={"PATH": str(tmp_path)})
    assert result.returncode == 3
    assert "kubectl is not on PATH" in result.stderr and "install" in result.stderr.lower()


def test_cli_script_target_is_not_applied(tmp_path: Path):
    result = pdlab("cluster", "apply", str(BASE_LAB), "--target", "script", "--dry-run")
    assert result.returncode == 2 and "--target" in result.stderr


@pytest.mark.parametrize("target", ["k8s", "script"])
def test_router_argv_parses_with_the_router_cli(target: str):
    """The rendered `pdlab router serve` line is parsed (not run) by the router's own command-line definition."""
    import typer

    from pdlab.router.cli import app as router_app

    serve = typer.main.get_command(router_app).commands["serve"]
    files = render(plan_of(raw(BASE_LAB)), target)
    if target == "k8s":
        argv = list(yaml.safe_load_all(files["router.yaml"]))[0]["spec"]["template"]["spec"]["containers"][0][
            "command"]
    else:
        argv = exec_argv(files["router.sh"])
    ctx = serve.make_context("serve", argv[3:])
    assert ctx.params["threshold"] == raw(BASE_LAB)["deployment"]["router"]["threshold"]
    assert ctx.params["decode"] and ctx.params["prefill"]


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
@pytest.mark.parametrize("target", ["k8s", "script"])
def test_router_names_the_decode_receivers_lmcache_listens_on(lab: Path, target: str):
    """The rendered router speaks LMCache's P/D protocol and names, for each decode replica, exactly the host and
    ports that replica's rendered LMCache config listens on: otherwise no KV would move."""
    from urllib.parse import urlsplit

    import typer

    from pdlab.config.options import spec_from_options
    from pdlab.config.router import RouterUpstreams
    from pdlab.router.cli import app as router_app

    files = render(plan_of(raw(lab)), target)
    if target == "k8s":
        argv = list(yaml.safe_load_all(files["router.yaml"]))[0]["spec"]["template"]["spec"]["containers"][0][
            "command"]
        decode_config = yaml.safe_load(yaml.safe_load(files["lmcache-config.yaml"])["data"]["lmcache-decode.yaml"])
        decode_set = list(yaml.safe_load_all(files["decode.yaml"]))[1]
        meta, spec = decode_set["metadata"], decode_set["spec"]
        # A StatefulSet pod's DNS name: <pod>.<governing service>.<namespace>.svc.cluster.local.
        pods = [f"{meta['name']}-{i}.{spec['serviceName']}.{meta['namespace']}.svc.cluster.local"
                for i in range(spec["replicas"])]
    else:
        argv = exec_argv(files["router.sh"])
        decode_config = yaml.safe_load(files["lmcache-decode.yaml"])
        pods = [line.split("run on each of ", 1)[1].split(" (")[0].split(", ") for line in
                files["decode.sh"].splitlines() if "run on each of" in line][0]
    params = typer.main.get_command(router_app).commands["serve"].make_context("serve", argv[3:]).params
    assert params["kv_protocol"] == "lmcache"
    upstreams = spec_from_options(RouterUpstreams, params)
    assert upstreams.lmcache_init_ports == decode_config["pd_peer_init_port"]
    assert upstreams.lmcache_alloc_ports == decode_config["pd_peer_alloc_port"]
    assert decode_config["pd_peer_host"] == "0.0.0.0"  # so the replica's own name reaches its receiver
    assert [urlsplit(u).hostname for u in params["decode"]] == pods  # receiver host = each decode URL's host
