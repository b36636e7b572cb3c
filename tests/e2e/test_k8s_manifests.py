"""deploy/k8s/, checked offline: every manifest is built into the Kubernetes Python client's models (KServe's
for KServe kinds), field by field, so that an unknown field, a wrong type or a missing required field fails
here rather than at `kubectl apply`; and every image target, port, flag and setting it names exists in the
Dockerfile and the command line."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client comes with the test extra")
yaml = pytest.importorskip("yaml")
if importlib.util.find_spec("kserve") is None:
    pytest.skip("kserve's models come with the test extra", allow_module_level=True)

from kubernetes.client import models as k8s_models  # noqa: E402


def _kserve_models():
    """kserve's generated models alone. The kserve package's own __init__ also loads its gRPC stubs, which
    register the protobuf package 'inference' that mhaserve's stubs already registered in this process (one
    process cannot hold both, as with tritonclient): the package is entered without running it."""
    if "kserve" not in sys.modules:
        package = types.ModuleType("kserve")
        package.__path__ = list(importlib.util.find_spec("kserve").submodule_search_locations)
        sys.modules["kserve"] = package
    return importlib.import_module("kserve.models")


kserve_models = _kserve_models()

from mhaserve.cli import build_parser  # noqa: E402
from mhaserve.server.config import ENV_PREFIX, ServerSettings, settings_from_args  # noqa: E402
from tests.support import ROOT  # noqa: E402

K8S = ROOT / "deploy" / "k8s"
MODEL_CLASSES = {
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("batch/v1", "Job"): "V1Job",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}
PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object, "datetime": str}


class ManifestError(ValueError):
    pass


def build_model(data, type_name: str, path: str = ""):
    """``data`` as the client model ``type_name``; ManifestError naming the field on an unknown field or a wrong
    type, and the model's own client-side validation (required fields, enumerations) on the rest."""
    if match := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        if not isinstance(data, list):
            raise ManifestError(f"{path}: expected a list, got {type(data).__name__}")
        return [build_model(item, match.group(1), f"{path}[{i}]") for i, item in enumerate(data)]
    if match := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name):
        if not isinstance(data, dict):
            raise ManifestError(f"{path}: expected a mapping, got {type(data).__name__}")
        value_type = match.group(1) or match.group(2)
        return {key: build_model(value, value_type, f"{path}.{key}") for key, value in data.items()}
    if type_name in PRIMITIVES:
        if not isinstance(data, PRIMITIVES[type_name]) or (type_name == "int" and isinstance(data, bool)):
            raise ManifestError(f"{path}: expected {type_name}, got {type(data).__name__} {data!r}")
        return data
    klass = getattr(kserve_models, type_name, None) or getattr(k8s_models, type_name)
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: expected a {type_name} mapping, got {type(data).__name__}")
    attribute_of = {json_name: attribute for attribute, json_name in klass.attribute_map.items()}
    unknown = sorted(set(data) - set(attribute_of))
    if unknown:
        raise ManifestError(f"{path or type_name}: unknown field(s) {unknown} in {type_name}")
    kwargs = {
        attribute_of[name]: build_model(value, klass.openapi_types[attribute_of[name]], f"{path}.{name}")
        for name, value in data.items()
    }
    try:
        return klass(**kwargs)
    except ValueError as error:
        raise ManifestError(f"{path or type_name}: {error}") from None


def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [
                (f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc)
                for doc in yaml.safe_load_all(path.read_text())
            ]
    return docs


BALANCER = "mhaserve-sequence-balancer"  # HAProxy in front of the server pods (sequence-balancer.yaml)


def by_kind(kind: str) -> list[dict]:
    """The manifests of ``kind`` that run or serve mhaserve itself (the sequence balancer's apart)."""
    return [
        doc
        for _, doc in manifests()
        if doc["kind"] == kind
        and BALANCER not in doc["metadata"]["name"]
        and doc["metadata"]["name"] != "mhaserve-sequences"
    ]


def pod_containers(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "ServingRuntime":
        return spec["containers"]
    return spec["template"]["spec"]["containers"]


@pytest.mark.parametrize("name, doc", manifests(), ids=[name for name, _ in manifests()])
def test_every_manifest_is_a_valid_object_of_its_kind(name, doc):
    build_model(doc, MODEL_CLASSES[(doc["apiVersion"], doc["kind"])])


def test_a_misspelt_or_mistyped_field_is_caught():
    deployment = by_kind("Deployment")[0]
    with pytest.raises(ManifestError, match=r"unknown field\(s\) \['replica'\]"):
        build_model({**deployment, "spec": {**deployment["spec"], "replica": 2}}, "V1Deployment")
    with pytest.raises(ManifestError, match=r"\.spec\.replicas: expected int, got str"):
        build_model({**deployment, "spec": {**deployment["spec"], "replicas": "2"}}, "V1Deployment")
    with pytest.raises(ManifestError, match=r"(?s)\.spec\.ports\[0\]: .*\bport\s+Field required"):
        build_model({"apiVersion": "v1", "kind": "Service", "spec": {"ports": [{"name": "grpc"}]}}, "V1Service")


def test_images_are_the_dockerfiles_targets():
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "Dockerfile").read_text(), flags=re.M))
    images = {
        c["image"] for kind in ("Deployment", "Job", "ServingRuntime") for d in by_kind(kind) for c in pod_containers(d)
    }
    assert images == {"mhaserve-server", "mhaserve-export"}
    assert {image.removeprefix("mhaserve-") for image in images} <= targets
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert {entry["name"] for entry in kustomization["images"]} == images
    assert all((K8S / resource).is_file() for resource in kustomization["resources"])


def parse_command(args: list[str]) -> argparse.Namespace:
    """The container's arguments as the image's entry point (mhaserve) parses them; a flag it lacks fails."""
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"mhaserve does not accept {args}")


def settings_of(container: dict) -> ServerSettings:
    """The server settings a container runs with: its MHASERVE_* environment, then its flags."""
    fields = set(ServerSettings.__dataclass_fields__)
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    for name in env:
        assert name.startswith(ENV_PREFIX) and name.removeprefix(ENV_PREFIX).lower() in fields, name
    with mock.patch.dict(os.environ, env, clear=False):
        return settings_from_args(parse_command(container["args"]))


def test_every_command_flag_and_setting_exists_and_ports_are_the_servers():
    for doc in by_kind("Job"):
        for container in pod_containers(doc):
            assert parse_command(container["args"]).command == "export"
    for doc in by_kind("Deployment") + by_kind("ServingRuntime"):
        for container in pod_containers(doc):
            settings = settings_of(container)
            ports = {port["containerPort"] for port in container["ports"]}
            assert settings.port in ports and settings.host == "0.0.0.0"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:  # Kubernetes' gRPC probe: grpc.health.v1 on the serving port
                    assert container[probe]["grpc"]["port"] == settings.port
            if doc["kind"] == "Deployment":
                assert {settings.http_port, settings.metrics_port} <= ports
                assert settings.model_repository == Path("/models")
            else:  # KServe mounts the storageUri's model here
                assert settings.model_dir == Path("/mnt/models")


def test_services_budgets_and_autoscaler_select_the_server_pods():
    deployment = by_kind("Deployment")[0]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (service,) = by_kind("Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS names every pod, for client-side round robin
    assert service["spec"]["selector"].items() <= labels.items()
    container_ports = {p["name"] for p in pod_containers(deployment)[0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    (budget,) = by_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (autoscaler,) = by_kind("HorizontalPodAutoscaler")
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert budget["spec"]["minAvailable"] < autoscaler["spec"]["minReplicas"]


def test_the_sequence_balancer_is_a_valid_haproxy_config_hashing_the_header_over_the_server_pods(tmp_path):
    docs = {doc["kind"]: doc for _, doc in manifests() if BALANCER in doc["metadata"]["name"] or
            doc["metadata"]["name"] == "mhaserve-sequences"}  # fmt: skip
    config = docs["ConfigMap"]["data"]["haproxy.cfg"]
    headless = next(doc for doc in manifests_of("Service") if doc["metadata"]["name"] == "mhaserve-headless")
    ports = {port["name"]: port["port"] for port in headless["spec"]["ports"]}
    for backend, port in (("grpc_servers", ports["grpc"]), ("http_servers", ports["http"])):
        section = config.split(f"\nbackend {backend}", 1)[1].split("\nbackend ", 1)[0]
        assert "balance hdr(mhaserve-sequence-id)" in section and "hash-type consistent" in section
        assert f"mhaserve-headless:{port}" in section  # every pod, from the headless Service's DNS
    (container,) = pod_containers(docs["Deployment"])
    assert container["image"].startswith("haproxy:")
    assert (
        docs["Service"]["spec"]["selector"].items()
        <= docs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )
    if shutil.which("haproxy") is None:
        pytest.skip("no haproxy to check the configuration with (tests/tools/install_haproxy.sh installs Debian's)")
    (tmp_path / "haproxy.cfg").write_text(config)
    checked = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def manifests_of(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def test_kserve_services_use_the_oip_over_grpc_and_the_exports_on_the_volume():
    runtime = by_kind("ServingRuntime")[0]
    claim = by_kind("PersistentVolumeClaim")[0]["metadata"]["name"]
    export = parse_command(pod_containers(by_kind("Job")[0])[0]["args"])
    for service in by_kind("InferenceService"):
        model = service["spec"]["predictor"]["model"]
        assert model["protocolVersion"] == "grpc-v2"
        assert model["storageUri"].startswith(f"pvc://{claim}/")
        if model["modelFormat"]["name"] == "triton":
            assert model["storageUri"] == f"pvc://{claim}/{export.triton_repo.relative_to('/models')}"
        else:
            assert model["runtime"] == runtime["metadata"]["name"]
            first_version = (export.repository / export.name / "1").relative_to("/models")
            assert model["storageUri"] == f"pvc://{claim}/{first_version}"
            assert "grpc-v2" in runtime["spec"]["protocolVersions"]
