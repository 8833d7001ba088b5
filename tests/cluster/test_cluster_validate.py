"""Rendered cluster files checked by the real consumers' own schemas and loaders:
- the HyperPod object against the operator's CRD (data/hyperpod/, strict: unknown fields fail);
- Deployments, Services and ConfigMaps through the official Kubernetes client's models (round trip: a field the
  models do not know would be dropped, so the round trip differs);
- every LMCache config through LMCache's own loader (installed by `make setup`), as its vLLM adapter loads it, in
  a process of its own with no LMCACHE_* variables: LMCache only warns about unknown or renamed keys and drops
  them, so any warning fails;
- every `vllm serve` command line through vLLM's own `serve` parser, and its --kv-transfer-config into
  KVTransferConfig with a connector vLLM has registered.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdlab.cluster import crd
from pdlab.cluster.plan import load_plan
from pdlab.cluster.render import render

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_LABS = sorted((ROOT / "labs").glob("hyperpod-*.yaml"))
LAB_IDS = [lab.stem for lab in CLUSTER_LABS]
LMCACHE_CHECK = ROOT / "tests" / "cluster" / "lmcache_check.py"


def rendered(lab: Path, target: str) -> dict[str, str]:
    return render(load_plan(lab), target)


# --- HyperPod CRD -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def crd_schema() -> dict:
    return crd.crd_schema("v1")


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
def test_hyperpod_object_conforms_to_crd(lab: Path, crd_schema: dict):
    obj = yaml.safe_load(rendered(lab, "hyperpod")["inferenceendpointconfig.yaml"])
    assert obj["apiVersion"] == "inference.sagemaker.aws.amazon.com/v1" and obj["kind"] == "InferenceEndpointConfig"
    assert crd.problems(obj, crd_schema) == []


def test_crd_check_catches_mistakes(crd_schema: dict):
    obj = yaml.safe_load(rendered(CLUSTER_LABS[0], "hyperpod")["inferenceendpointconfig.yaml"])
    obj["spec"]["pdSpec"]["routingThreshold"] = -1
    obj["spec"]["pdSpec"]["decodingSpec"]["replica"] = 2
    obj["spec"]["intelligentRoutingSpec"]["routingStrategy"] = "leastloaded"
    del obj["spec"]["worker"]["image"]
    found = "\n".join(crd.problems(obj, crd_schema))
    for where in ("spec.pdSpec.routingThreshold", "spec.pdSpec.decodingSpec", "routingStrategy", "spec.worker"):
        assert where in found


def test_strategy_mapping_uses_the_crd_enum(crd_schema: dict):
    from pdlab.cluster.plan import HYPERPOD_STRATEGY

    routing = crd_schema["properties"]["spec"]["properties"]["intelligentRoutingSpec"]
    enum = routing["properties"]["routingStrategy"]["enum"]
    assert {v for v in HYPERPOD_STRATEGY.values() if v is not None} == set(enum)


def test_crd_copy_keeps_its_origin():
    first = (ROOT / "data" / crd.CRD_FILE).read_text().splitlines()[0]
    assert first.startswith("# origin: aws/sagemaker-hyperpod-cli @ 011ca927")


# --- Kubernetes models --------------------------------------------------------------------------------------------

def k8s_round_trip(doc: dict) -> dict:
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = api.deserialize(json.dumps(doc), f"{doc['apiVersion'].split('/')[-1].upper()}{doc['kind']}",
                            "application/json")
    return api.sanitize_for_serialization(model)


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
def test_k8s_manifests_are_valid_kubernetes_objects(lab: Path):
    kinds = []
    for name, text in rendered(lab, "k8s").items():
        for doc in yaml.safe_load_all(text):
            assert k8s_round_trip(doc) == doc, f"{name}: {doc['kind']} {doc['metadata']['name']}"
            kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "Deployment", "Service", "Service", "Service", "StatefulSet", "StatefulSet"]


def test_k8s_check_catches_mistakes():
    from pydantic import ValidationError

    doc = list(yaml.safe_load_all(rendered(CLUSTER_LABS[0], "k8s")["decode.yaml"]))[1]  # the StatefulSet
    doc["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # misspelt: the model drops it
    assert k8s_round_trip(doc) != doc
    doc["spec"]["replicas"] = "two"
    with pytest.raises(ValidationError):
        k8s_round_trip(doc)


# --- LMCache's own loader -----------------------------------------------------------------------------------------

def lmcache_load(paths: list[Path]) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    result = subprocess.run([sys.executable, str(LMCACHE_CHECK), *map(str, paths)], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def lmcache_files(tmp_path: Path) -> dict[Path, dict]:
    """Every LMCache config the shipped labs render (k8s ConfigMap entries and script files), written out."""
    files: dict[Path, dict] = {}
    for lab in CLUSTER_LABS:
        configmap = next(yaml.safe_load_all(rendered(lab, "k8s")["lmcache-config.yaml"]))
        script = {n: t for n, t in rendered(lab, "script").items() if n.startswith("lmcache-")}
        for origin, entries in (("k8s", configmap["data"]), ("script", script)):
            for name, text in entries.items():
                path = tmp_path / f"{lab.stem}-{origin}-{name}"
                path.write_text(text)
                files[path] = yaml.safe_load(text)
    return files


def test_lmcache_loads_every_rendered_config(tmp_path: Path):
    files = lmcache_files(tmp_path)
    assert len(files) == 4 * len(CLUSTER_LABS)
    loaded = lmcache_load(list(files))
    for path, written in files.items():
        report = loaded[str(path)]
        assert report["ok"], report
        assert report["warnings"] == [], f"{path.name}: LMCache warned {report['warnings']}"
        assert report["user_set"] == sorted(written), f"{path.name}: LMCache ignored some keys"
        assert report["values"] == written
        assert report["values"]["enable_pd"] is True and report["values"]["transfer_channel"] == "nixl"


def test_lmcache_check_rejects_old_key_names(tmp_path: Path):
    # The pre-0.5 P/D keys: LMCache drops them with a warning and runs without P/D, so they must fail here.
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"enable_nixl": True, "nixl_role": "sender", "nixl_buffer_size": 1 << 30}))
    report = lmcache_load([old])[str(old)]
    assert report["warnings"] and report["user_set"] != ["enable_nixl", "nixl_buffer_size", "nixl_role"]
    incomplete = tmp_path / "incomplete.yaml"
    incomplete.write_text(yaml.safe_dump({"enable_pd": True, "pd_role": "receiver"}))  # no buffer size
    assert not lmcache_load([incomplete])[str(incomplete)]["ok"]


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
def test_rendered_configs_never_use_old_lmcache_keys(lab: Path):
    old_keys = ("enable_nixl", "nixl_role", "nixl_peer_host", "nixl_peer_port", "nixl_receiver_port",
                "nixl_buffer_size", "nixl_buffer_device", "nixl_enable_gc", "enable_xpyd")
    for target in ("hyperpod", "k8s", "script"):
        for name, text in rendered(lab, target).items():
            for key in old_keys:
                assert f"{key}:" not in text, f"{target}/{name} uses the old LMCache key {key}"


# --- vLLM's own parser --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_serve():
    """vLLM's `vllm serve` argument parser (the real one; nothing is started)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
    return parser


def vllm_command_lines(lab: Path) -> dict[str, list[str]]:
    """Every rendered `vllm serve` argv (after `vllm`), by where it came from."""
    out: dict[str, list[str]] = {}
    for doc in yaml.safe_load_all("---\n".join(rendered(lab, "k8s").values())):
        if doc["kind"] == "StatefulSet":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            out[f"k8s/{doc['metadata']['name']}"] = [*container["command"][1:], *container["args"]]
    for name, text in rendered(lab, "script").items():
        if name in ("prefill.sh", "decode.sh"):
            argv = shlex.split(text.split("\nexec ", 1)[1].replace("\\\n", " "))
            out[f"script/{name}"] = argv[1:]
    spec = yaml.safe_load(rendered(lab, "hyperpod")["inferenceendpointconfig.yaml"])["spec"]
    for key in ("prefillSpec", "decodingSpec"):
        out[f"hyperpod/{key}"] = [*spec["worker"]["command"][1:], *spec["worker"]["args"], *spec["pdSpec"][key]["args"]]
    return out


@pytest.mark.parametrize("lab", CLUSTER_LABS, ids=LAB_IDS)
def test_vllm_parses_every_command_line(lab: Path, vllm_serve):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    plan = load_plan(lab)
    lines = vllm_command_lines(lab)
    assert len(lines) == 6
    for where, argv in lines.items():
        args = vllm_serve.parse_args(argv)
        role = plan.prefill if ("prefill" in where) else plan.decode
        assert args.subcommand == "serve"
        assert args.tensor_parallel_size == role.pool.tp, where
        assert args.served_model_name == [plan.model], where
        assert args.enable_prefix_caching == role.engine.enable_prefix_caching, where
        assert args.gpu_memory_utilization == role.pool.gpu_memory_utilization, where
        if where.startswith("hyperpod/"):
            assert args.kv_transfer_config is None  # HyperPod's operator configures KV transfer (kvCacheSpec)
            continue
        kv = args.kv_transfer_config
        assert isinstance(kv, KVTransferConfig), where
        assert kv.kv_connector in KVConnectorFactory._registry, where
        assert kv.kv_connector == "LMCacheConnectorV1"
        assert (kv.is_kv_producer, kv.is_kv_consumer) == ((True, False) if role.role == "prefill" else (False, True))
        assert kv.kv_buffer_device == "cuda"
