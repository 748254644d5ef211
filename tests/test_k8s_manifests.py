"""k8s/: every manifest, and every combination of the kustomize components, is validated without
a Kubernetes API server (none runs here).

- RayJob and RayCluster: against KubeRay's own CRD openAPIV3Schema (v1), read from
  `../shared/schemas/kuberay/` with PyYAML and jsonschema. A CRD schema alone lets unknown
  fields through (the API server prunes them silently), so the schema is made strict first:
  every object schema that lists `properties` and neither sets `additionalProperties` nor
  `x-kubernetes-preserve-unknown-fields` gets `additionalProperties: false`. Their pod
  templates are validated a second time against the Kubernetes core schemas. Not checked: the
  CRD's CEL rules (`x-kubernetes-validations`; none applies to the fields used here) and
  object metadata, which the CRD leaves open and which `METADATA_SCHEMA` below checks instead.
- Core kinds (PersistentVolumeClaim, NetworkPolicy, ConfigMap, pod templates): against the
  Kubernetes JSON schemas that the `kubernetes-validate` package ships (strict: unknown fields
  are errors), for the oldest and newest Kubernetes versions in CORE_VERSIONS.
- PodMonitor: no Prometheus Operator schema package is installed here, so it is checked
  against a minimal schema written below for exactly the fields used (unknown fields are
  errors); it is not the upstream schema.
- `kubectl kustomize` (the kubectl installed on these machines; CI fails without it) builds
  k8s/ with every subset of its components, and each build is validated as above and checked
  for the properties a platform team asks of it: Ray token authentication on, the network
  policy present, hardened containers, the preStop hook, the deadlines, the storage class, and
  only registry-qualified images.
- Cross-checks: the RayJob's cluster equals the standing RayCluster, the submitter runs the
  entrypoint, the PodMonitors' ports exist on the pods they select and the network policy
  admits Prometheus to them, the claim and mount paths agree with the entrypoint, the GPU
  workers require a driver of the image's CUDA, every pod shares one writable Hugging Face
  cache, an init step lets the pods' user write the claim's folders before Ray starts, the
  dashboard ConfigMap holds deploy/'s dashboard, and the grace period covers a step and a
  checkpoint of the 7B recipe.
"""

import copy
import functools
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.prometheus import PrometheusExporter

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parent.parent
K8S = ROOT / "k8s"
SCHEMAS = ROOT.parent / "shared" / "schemas" / "kuberay"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# The image is CUDA 13.0 (the CUDA of the torch that vllm 0.33.0 pins), which needs an NVIDIA
# driver >= 580 (tests/test_dockerfile.py holds how that was read). GPU feature discovery's
# label of the driver's major version; node affinity's Gt compares it as an integer.
DRIVER_FLOOR = 580
DRIVER_MAJOR_LABEL = "nvidia.com/cuda.driver.major"
COMPONENTS = K8S / "components"
RDMA_COMPONENT = COMPONENTS / "rdma"
# Kubernetes versions whose core schemas (kubernetes-validate) every manifest must pass.
CORE_VERSIONS = ("1.30", "1.36")
CORE_KINDS = {"PersistentVolumeClaim", "NetworkPolicy", "ConfigMap", "PodTemplate", "Secret"}
# The example resource name of k8s-rdma-shared-dev-plugin (README.md, "RDMA").
RDMA_RESOURCE = "rdma/hca_shared_devices_a"
OWNER_STEP = "shared-volume-owner"

_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE]|m)?$"
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

METADATA_SCHEMA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": _NAME, "maxLength": 63},
        "namespace": {"type": "string", "pattern": _NAME},
        "labels": {
            "type": "object",
            "propertyNames": {"pattern": _LABEL_KEY},
            "additionalProperties": {"type": "string", "maxLength": 63},
        },
        "annotations": _STRING_MAP,
    },
}


def _manifest(kind: str, api_version: str, spec: dict | None, **extra) -> dict:
    properties = {
        "apiVersion": {"const": api_version},
        "kind": {"const": kind},
        "metadata": METADATA_SCHEMA,
        **extra,
    }
    if spec is not None:
        properties["spec"] = spec
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata"],
        "additionalProperties": False,
        "properties": properties,
    }


def _object(required: list[str], **properties) -> dict:
    return {
        "type": "object",
        "required": required,
        "additionalProperties": False,
        "properties": properties,
    }


# Minimal schemas for the fields these manifests use (see the module docstring).
BUILTIN_SCHEMAS = {
    "PodMonitor": _manifest(
        "PodMonitor",
        "monitoring.coreos.com/v1",
        _object(
            ["selector", "podMetricsEndpoints"],
            jobLabel={"type": "string"},
            selector=_object(["matchLabels"], matchLabels=_STRING_MAP),
            namespaceSelector=_object([], any={"type": "boolean"}, matchNames={"type": "array"}),
            podMetricsEndpoints={
                "type": "array",
                "minItems": 1,
                "items": _object(
                    ["port"],
                    port={"type": "string", "pattern": _NAME},
                    path={"type": "string", "pattern": "^/"},
                    interval={"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
                    scheme={"enum": ["http", "https"]},
                    honorLabels={"type": "boolean"},
                    relabelings={
                        "type": "array",
                        "items": _object(
                            [],
                            sourceLabels={"type": "array", "items": {"type": "string"}},
                            targetLabel={"type": "string"},
                            action={"enum": ["replace", "keep", "drop", "labelmap"]},
                            regex={"type": "string"},
                            replacement={"type": "string"},
                        ),
                    },
                ),
            },
        ),
    ),
}


# ------------------------------------------------------------------------------ schemas


def strict(schema: dict) -> dict:
    """A copy of an openAPIV3Schema in which objects with listed properties allow no others."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / CRD_FILES[kind]
    if not path.exists():
        message = f"KubeRay CRD schema {path} is missing (shared/ beside the repo)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with path.open() as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = METADATA_SCHEMA
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return jsonschema.Draft7Validator(schema)


def core_validate():
    """kubernetes_validate.validate, or a skip (a failure on CI) when it is not installed."""
    try:
        import kubernetes_validate
    except ImportError:
        message = "kubernetes-validate is not installed (the dev extra of pyproject.toml)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return kubernetes_validate


def core_errors(doc: dict) -> list[str]:
    """Errors of a core-kind manifest against Kubernetes' own schemas, strict, per version."""
    kubernetes_validate = core_validate()
    errors = []
    for version in CORE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(p) for p in error.path) or "<root>"
            errors.append(f"{version} {path}: {error.message}")
    return errors


def pod_template_errors(template: dict) -> list[str]:
    """A RayCluster's pod template as a core PodTemplate."""
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
    return core_errors(doc | {"template": template})


def validation_errors(doc: dict) -> list[str]:
    kind = doc.get("kind")
    if kind in CORE_KINDS:
        return core_errors(doc)
    if kind in CRD_FILES:
        validator = crd_validator(kind)
    elif kind in BUILTIN_SCHEMAS:
        validator = jsonschema.Draft7Validator(BUILTIN_SCHEMAS[kind])
    else:
        return [f"kind {kind!r} has no schema in this test"]
    errors = [
        f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(doc)
    ]
    if kind in CRD_FILES:
        spec = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
        templates = dict(pod_templates(spec))
        if kind == "RayJob" and "submitterPodTemplate" in doc["spec"]:
            templates["submitter"] = doc["spec"]["submitterPodTemplate"]
        for group, template in templates.items():
            errors += [f"{group} pod template: {e}" for e in pod_template_errors(template)]
    return errors


# ---------------------------------------------------------------------------- manifests


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def is_manifest(path: Path) -> bool:
    """A file of Kubernetes objects (not a kustomization, not a component's JSON patch)."""
    docs = load_docs(path)
    return path.name != "kustomization.yaml" and all(isinstance(d, dict) for d in docs)


MANIFEST_FILES = sorted(p for p in K8S.rglob("*.yaml") if is_manifest(p))


@functools.cache
def manifests() -> dict[str, list[dict]]:
    return {str(path.relative_to(K8S)): load_docs(path) for path in MANIFEST_FILES}


def of_kind(kind: str) -> list[dict]:
    return [doc for docs in manifests().values() for doc in docs if doc["kind"] == kind]


def first(kind: str) -> dict:
    return of_kind(kind)[0]


def one(kind: str) -> dict:
    [doc] = of_kind(kind)
    return doc


def pod_templates(cluster_spec: dict) -> dict[str, dict]:
    """{"head" | worker group name: pod template} of a RayClusterSpec."""
    templates = {"head": cluster_spec["headGroupSpec"]["template"]}
    for group in cluster_spec["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return templates


@pytest.mark.parametrize(
    "path, index",
    [(p, i) for p in MANIFEST_FILES for i in range(len(load_docs(p)))],
    ids=lambda v: str(v.relative_to(K8S)) if isinstance(v, Path) else str(v),
)
def test_manifest_validates(path, index):
    doc = load_docs(path)[index]
    errors = validation_errors(doc)
    assert not errors, f"{path.name} ({doc.get('kind')}):\n  " + "\n  ".join(errors)


@pytest.mark.parametrize(
    "kind, mutate, fragment",
    [
        (
            "RayJob",
            lambda d: d["spec"].update(shutdownAfterJobFinish=True),
            "shutdownAfterJobFinish",
        ),
        (
            "RayJob",
            lambda d: d["spec"]["submitterConfig"].update(backofLimit=2),
            "backofLimit",
        ),
        (
            "RayJob",
            lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
                "containers"
            ][0].update(volumeMount=[]),
            "volumeMount",
        ),
        (
            "RayJob",
            lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(
                toleration=[]
            ),
            "toleration",
        ),
        ("RayJob", lambda d: d["spec"].update(backoffLimit="3"), "is not of type 'integer'"),
        (
            "RayCluster",
            lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0}),
            "is not of type 'string'",
        ),
        ("RayCluster", lambda d: d["metadata"].update(lables={}), "lables"),
        (
            "PersistentVolumeClaim",
            lambda d: d["spec"].update(accesModes=["ReadWriteMany"]),
            "accesModes",
        ),
        ("ConfigMap", lambda d: d.update(date={}), "date"),
        (
            "PodMonitor",
            lambda d: d["spec"]["podMetricsEndpoints"][0].update(targetPort=8080),
            "targetPort",
        ),
    ],
)
def test_a_misspelled_or_mistyped_field_fails_validation(kind, mutate, fragment):
    doc = copy.deepcopy(first(kind))
    assert not validation_errors(doc)
    mutate(doc)
    errors = validation_errors(doc)
    assert any(fragment in e for e in errors), errors


def test_strict_keeps_maps_and_preserved_objects_open():
    schema = {
        "type": "object",
        "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"b": {"type": "integer"}}},
            },
        },
    }
    validator = jsonschema.Draft7Validator(strict(schema))
    assert validator.is_valid({"labels": {"x": "y"}, "free": {"z": 1}, "items": [{"b": 1}]})
    assert not validator.is_valid({"items": [{"c": 1}]})
    assert not validator.is_valid({"other": 1})


# ------------------------------------------------------------------------- the RayJob


def test_rayjob_runs_the_async_config_and_resumes_on_the_shared_volume():
    job = one("RayJob")["spec"]
    argv = shlex.split(job["entrypoint"])
    assert argv[:5] == ["python", "-m", "cagrpo_ray.run", "--config", "configs/async.yaml"]
    assert argv[argv.index("--resume") + 1] == "auto"  # a retry continues, a first try starts
    overrides = dict(argv[i + 1].split("=", 1) for i, word in enumerate(argv) if word == "--set")
    # The resolved config trains asynchronously on GPUs and fits the cluster's 16 GPUs.
    configs = [ROOT / argv[i + 1] for i, word in enumerate(argv) if word == "--config"]
    config = load_config(configs, [f"{k}={v}" for k, v in overrides.items()])
    assert config.run.max_staleness >= 1 and config.algorithm.tis_cap is not None
    r, lcfg = config.rollout, config.learner
    gpus = r.num_generators * r.num_gpus_per_generator
    gpus += lcfg.num_learners * lcfg.num_gpus_per_learner
    assert 0 < gpus <= 16 and r.num_gpus_per_generator > 0
    output_dir = overrides["run.output_dir"]
    assert job["backoffLimit"] >= 1 and job["submitterConfig"]["backoffLimit"] >= 1
    assert job["shutdownAfterJobFinishes"] is True and job["ttlSecondsAfterFinished"] > 0
    claim = one("PersistentVolumeClaim")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    for group, template in pod_templates(job["rayClusterSpec"]).items():
        spec = template["spec"]
        volumes = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        }
        mounts = {m["mountPath"]: m for c in spec["containers"] for m in c["volumeMounts"]}
        checkpoints = mounts[output_dir]
        assert volumes[checkpoints["name"]] == claim["metadata"]["name"], group
        assert not checkpoints.get("readOnly"), group
        # The entrypoint's relative config path resolves in the image's /app.
        assert all(c["workingDir"] == "/app" for c in spec["containers"]), group


def test_the_rayjob_cluster_is_the_raycluster():
    assert one("RayJob")["spec"]["rayClusterSpec"] == one("RayCluster")["spec"]


def test_ray_version_and_images_match_the_package():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [ray_pin] = [d for d in pyproject["project"]["dependencies"] if d.startswith("ray[")]
    cluster = one("RayCluster")["spec"]
    assert ray_pin.endswith("==" + cluster["rayVersion"])
    images = {c["image"] for t in pod_templates(cluster).values() for c in t["spec"]["containers"]}
    assert len(images) == 1 and images.pop().endswith("-gpu")


def test_head_has_no_gpus_and_workers_request_gpus_on_gpu_nodes():
    cluster = one("RayCluster")["spec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    [head_container] = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        [container] = spec["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert any(
            t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule"
            for t in spec["tolerations"]
        )
        assert spec["nodeSelector"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG"} <= set(env)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_gpu_workers_only_land_on_nodes_with_a_cuda_13_driver():
    cluster = one("RayCluster")["spec"]
    for group in cluster["workerGroupSpecs"]:
        required = group["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        # Terms are alternatives: each one must carry the driver floor.
        for term in required["nodeSelectorTerms"]:
            floors = [e for e in term["matchExpressions"] if e["key"] == DRIVER_MAJOR_LABEL]
            assert floors == [
                {"key": DRIVER_MAJOR_LABEL, "operator": "Gt", "values": [str(DRIVER_FLOOR - 1)]}
            ], (group["groupName"], term)
    readme = " ".join((K8S / "README.md").read_text().split())
    assert DRIVER_MAJOR_LABEL in readme and f"driver >= {DRIVER_FLOOR}" in readme


def test_every_pod_shares_one_writable_hugging_face_cache_on_the_claim():
    """The driver (head) fetches the model once; the actors on the workers load it from there."""
    claim = one("PersistentVolumeClaim")["metadata"]["name"]
    caches = set()
    for group, template in pod_templates(one("RayCluster")["spec"]).items():
        spec = template["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        }
        for container in spec["containers"]:
            hf_home = {e["name"]: e.get("value") for e in container["env"]}["HF_HOME"]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert hf_home in mounts, (group, hf_home)
            mount = mounts[hf_home]
            assert claims[mount["name"]] == claim and not mount.get("readOnly"), (group, mount)
            caches.add((hf_home, mount.get("subPath")))
    assert len(caches) == 1, caches


def test_requests_equal_limits_and_pods_run_as_non_root():
    for group, template in pod_templates(one("RayCluster")["spec"]).items():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for container in spec["containers"]:
            resources = container["resources"]
            assert resources["requests"] == resources["limits"], group
            assert {"cpu", "memory"} <= set(resources["limits"]), group


# ---------------------------------------------------------------- the shared volume's owner


def owner_step(template: dict) -> dict:
    [step] = [c for c in template["spec"].get("initContainers", []) if c["name"] == OWNER_STEP]
    return step


def test_an_init_step_lets_the_ray_user_write_the_claim_before_ray_starts():
    """fsGroup does not reach many ReadWriteMany volumes (NFS among them), so root, with
    CAP_CHOWN only, gives the Ray container's user the folders it writes on the claim."""
    claim = one("PersistentVolumeClaim")["metadata"]["name"]
    for group, template in pod_templates(one("RayCluster")["spec"]).items():
        spec = template["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        }
        [ray] = spec["containers"]
        writable = [
            m
            for m in ray["volumeMounts"]
            if claims.get(m["name"]) == claim and not m.get("readOnly")
        ]
        step = owner_step(template)
        # An init container (a sidecar would have restartPolicy Always) ends before Ray starts.
        assert "restartPolicy" not in step, group
        # The same volume, folders and paths as the Ray container's, given to the script.
        assert writable and step["volumeMounts"] == writable, group
        assert step["command"][:2] == ["/bin/sh", "-c"], group
        assert step["command"][4:] == [m["mountPath"] for m in writable], group
        uid, gid = spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]
        script = step["command"][2]
        assert f'chown {uid}:{gid} "$dir"' in script and f"-uid {uid} " in script, group
        security = step["securityContext"]
        assert security["runAsUser"] == 0 and security["runAsNonRoot"] is False, group
        assert security["allowPrivilegeEscalation"] is False, group
        assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}, group
        # One image to pull, and to mirror for an offline cluster.
        assert step["image"] == ray["image"], group
        assert step["resources"]["requests"] == step["resources"]["limits"], group


def run_owner_step(tmp_path: Path, mode: int, chown_status: int) -> tuple[int, str, str]:
    """The head's init script on one local folder of `mode`, with a stand-in `chown` on PATH
    that logs its arguments and exits `chown_status`: (exit status, stderr, chown's log)."""
    if shutil.which("find") is None or os.getuid() == 1000 or os.getgid() == 1000:
        pytest.skip("needs find(1) and a user other than uid/gid 1000, the pods' user")
    folder, bin_dir, log = tmp_path / "hf-cache", tmp_path / "bin", tmp_path / "chown.log"
    folder.mkdir()
    folder.chmod(mode)
    bin_dir.mkdir()
    chown = bin_dir / "chown"
    chown.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\nexit {chown_status}\n')
    chown.chmod(0o755)
    command = owner_step(one("RayCluster")["spec"]["headGroupSpec"]["template"])["command"]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [*command[:4], str(folder)], env=env, capture_output=True, text=True, timeout=60
    )
    return result.returncode, result.stderr, log.read_text() if log.exists() else ""


def test_the_owner_step_leaves_a_folder_that_uid_1000_can_write(tmp_path):
    # World-writable and owned by someone else, as on an NFS export opened up for squashed root.
    assert run_owner_step(tmp_path, 0o777, chown_status=1) == (0, "", "")


def test_the_owner_step_chowns_a_folder_that_uid_1000_cannot_write(tmp_path):
    folder = tmp_path / "hf-cache"
    assert run_owner_step(tmp_path, 0o755, chown_status=0) == (0, "", f"1000:1000 {folder}\n")


def test_the_owner_step_fails_the_pod_with_a_pointer_when_it_cannot_chown(tmp_path):
    status, stderr, _ = run_owner_step(tmp_path, 0o755, chown_status=1)
    assert status == 1 and "root_squash" in stderr and "k8s/README.md" in stderr, stderr


# ------------------------------------------------------------------ monitoring wiring


def container_ports(template: dict) -> dict[str, int]:
    return {
        port["name"]: port["containerPort"]
        for container in template["spec"]["containers"]
        for port in container.get("ports", [])
    }


def test_podmonitors_scrape_ports_that_the_selected_pods_expose():
    cluster = one("RayCluster")["spec"]
    node_types = {"head": [cluster["headGroupSpec"]["template"]]}
    node_types["worker"] = [g["template"] for g in cluster["workerGroupSpecs"]]
    monitors = of_kind("PodMonitor")
    assert {m["spec"]["selector"]["matchLabels"]["ray.io/node-type"] for m in monitors} == {
        "head",
        "worker",
    }
    for monitor in monitors:
        labels = dict(monitor["spec"]["selector"]["matchLabels"])
        node_type = labels.pop("ray.io/node-type")
        for template in node_types[node_type]:
            assert labels.items() <= template["metadata"]["labels"].items()
            ports = container_ports(template)
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint["port"] in ports, (monitor["metadata"]["name"], endpoint)
            assert ports["metrics"] == 8080
    head_ports = container_ports(cluster["headGroupSpec"]["template"])
    # The driver's exporter listens on its default port, the one the head exposes.
    exporter = PrometheusExporter("k8s-test")
    assert head_ports["driver-metrics"] == exporter.port == 9400
    head_monitor = next(m for m in monitors if "head" in m["metadata"]["name"])
    assert {e["port"] for e in head_monitor["spec"]["podMetricsEndpoints"]} == {
        "driver-metrics",
        "metrics",
        "dash-metrics",
    }
    assert cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"
    # Ray's dashboard exports its own metrics on this port (ray/dashboard/consts.py).
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    assert head_ports["dash-metrics"] == DASHBOARD_METRIC_PORT
    # The network policy admits the monitoring namespace to every scraped port.
    scraped = {
        container_ports(t)[e["port"]]
        for m in monitors
        for t in node_types[m["spec"]["selector"]["matchLabels"]["ray.io/node-type"]]
        for e in m["spec"]["podMetricsEndpoints"]
    }
    [monitoring] = [
        rule
        for rule in one("NetworkPolicy")["spec"]["ingress"]
        if any("namespaceSelector" in peer and "podSelector" not in peer for peer in rule["from"])
    ]
    assert scraped == {port["port"] for port in monitoring["ports"]}


def test_dashboard_configmap_holds_deploys_dashboard_for_the_grafana_sidecar():
    configmap = one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = ROOT / "deploy" / "grafana" / "dashboards" / "cagrpo_ray.json"
    assert configmap["data"] == {"cagrpo_ray.json": dashboard.read_text()}
    json.loads(configmap["data"]["cagrpo_ray.json"])


BASE_RESOURCES = {"pvc.yaml", "networkpolicy.yaml", "rayjob.yaml"}


def component_names() -> list[str]:
    """The components in the order kustomization.yaml lists them (standing-cluster first, so
    that the others' patches reach its RayCluster)."""
    text = (K8S / "kustomization.yaml").read_text()
    offered = re.findall(r"^#   - components/([\w-]+) ", text, re.M)
    assert sorted(offered) == sorted(p.parent.name for p in COMPONENTS.glob("*/kustomization.yaml"))
    return offered


def test_kustomization_lists_the_base_and_offers_every_component():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization["resources"]) == BASE_RESOURCES
    # Each component is offered, commented out, in the kustomization's own text.
    text = (K8S / "kustomization.yaml").read_text()
    for name in component_names():
        assert f"#   - components/{name} " in text, name
        component = yaml.safe_load((COMPONENTS / name / "kustomization.yaml").read_text())
        assert component["kind"] == "Component", name
    # Every manifest is in the base or in a component.
    owned = {K8S / r for r in BASE_RESOURCES}
    for name in component_names():
        component = yaml.safe_load((COMPONENTS / name / "kustomization.yaml").read_text())
        owned |= {COMPONENTS / name / r for r in component.get("resources", [])}
    assert owned == set(MANIFEST_FILES)


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl (with its built-in kustomize) is missing on CI")
        pytest.skip("kubectl not installed")
    return path


def kustomize(tmp_path: Path, components: tuple[str, ...]) -> list[dict]:
    """`kubectl kustomize` of a copy of k8s/ with `components` switched on."""
    overlay = tmp_path / "-".join(components or ("base",)) / "k8s"
    shutil.copytree(K8S, overlay)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    if components:
        kustomization["components"] = [f"components/{name}" for name in components]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run(
        [kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, (components, result.stderr)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def qualified(image: str) -> bool:
    """A registry host first (docker.io's short names and local names are not)."""
    host, slash, _ = image.partition("/")
    return bool(slash) and ("." in host or ":" in host or host == "localhost")


def built_pod_templates(doc: dict) -> dict[str, dict]:
    if doc["kind"] == "RayJob":
        templates = pod_templates(doc["spec"]["rayClusterSpec"])
        return templates | {"submitter": doc["spec"]["submitterPodTemplate"]}
    return pod_templates(doc["spec"])


def check_build(docs: list[dict], components: tuple[str, ...]) -> None:
    """The properties every build must have, whatever its components."""
    kinds = [doc["kind"] for doc in docs]
    clusters = [d for d in docs if d["kind"] in ("RayJob", "RayCluster")]
    assert len(clusters) == 1, kinds
    [cluster] = clusters
    expected = {"PersistentVolumeClaim", "NetworkPolicy", cluster["kind"]}
    if "monitoring" in components:
        expected |= {"PodMonitor", "ConfigMap"}
    assert set(kinds) == expected, kinds
    assert ("standing-cluster" in components) == (cluster["kind"] == "RayCluster")
    for doc in docs:
        errors = validation_errors(doc)
        assert not errors, (components, doc["kind"], errors)
    spec = cluster["spec"]["rayClusterSpec"] if cluster["kind"] == "RayJob" else cluster["spec"]
    assert spec["authOptions"]["mode"] == "token"
    assert ("own-token" in components) == ("secretName" in spec["authOptions"])
    [claim] = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"]
    labels = cluster["metadata"]["labels"]
    assert ("kueue" in components) == ("kueue.x-k8s.io/queue-name" in labels)
    assert ("volcano" in components) == ("volcano.sh/queue-name" in labels)
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for group, template in built_pod_templates(cluster).items():
        assert labels_select(policy["spec"]["podSelector"], template["metadata"]["labels"]), group
        check_hardened(group, template["spec"])
        for container in all_containers(template["spec"]):
            assert qualified(container["image"]), (components, group, container["image"])


def labels_select(selector: dict, labels: dict) -> bool:
    return selector["matchLabels"].items() <= labels.items()


def all_containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def check_hardened(group: str, pod_spec: dict) -> None:
    """Pod Security "restricted" for every container but the init step, which runs as root
    with CAP_CHOWN alone (docs/deployment.md, "The shared volume's owner")."""
    pod = pod_spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 1000, group
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, group
    for container in all_containers(pod_spec):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, (group, container["name"])
        assert security["readOnlyRootFilesystem"] is True, (group, container["name"])
        assert security["capabilities"]["drop"] == ["ALL"], (group, container["name"])
        added = security["capabilities"].get("add", [])
        assert added == (["CHOWN"] if container["name"] == OWNER_STEP else []), group
        assert "privileged" not in security and "seccompProfile" not in security, group


COMBINATIONS = [
    combo
    for n in range(len(component_names()) + 1)
    for combo in itertools.combinations(component_names(), n)
]


def test_kustomize_builds_every_combination_of_components(tmp_path):
    assert {"monitoring", "rdma", "kueue", "volcano", "own-token", "standing-cluster"} <= set(
        component_names()
    )
    for components in COMBINATIONS:
        check_build(kustomize(tmp_path, components), components)


def test_the_build_checks_catch_what_they_guard_against(tmp_path):
    docs = kustomize(tmp_path, ())
    check_build(docs, ())
    breakages = [
        lambda c: c["spec"]["rayClusterSpec"].pop("authOptions"),
        lambda c: built_pod_templates(c)["gpu"]["spec"]["containers"][0]["securityContext"].update(
            allowPrivilegeEscalation=True
        ),
        lambda c: built_pod_templates(c)["head"]["spec"]["containers"][0].update(
            image="cagrpo-ray:0.1.0-gpu"
        ),
        lambda c: built_pod_templates(c)["gpu"]["spec"]["securityContext"].pop("seccompProfile"),
        lambda c: built_pod_templates(c)["submitter"]["spec"]["containers"][0]["securityContext"][
            "capabilities"
        ].update(add=["NET_RAW"]),
    ]
    for breakage in breakages:
        broken = copy.deepcopy(docs)
        breakage(next(d for d in broken if d["kind"] == "RayJob"))
        with pytest.raises((AssertionError, KeyError)):
            check_build(broken, ())
    without_policy = [d for d in docs if d["kind"] != "NetworkPolicy"]
    with pytest.raises(AssertionError):
        check_build(without_policy, ())


# ---------------------------------------------------------------------- the RDMA component


def json_patch(doc: dict, operations: list[dict]) -> dict:
    """A copy of `doc` with RFC 6902 operations applied: "add" and "test", those that the
    components here use (kustomize applies the same ones)."""
    out = copy.deepcopy(doc)
    for operation in operations:
        keys = [k.replace("~1", "/").replace("~0", "~") for k in operation["path"].split("/")[1:]]
        parent = out
        for key in keys[:-1]:
            parent = parent[int(key)] if isinstance(parent, list) else parent[key]
        last = keys[-1]
        if isinstance(parent, list):
            last = len(parent) if last == "-" else int(last)
        if operation["op"] == "test":
            assert parent[last] == operation["value"], f"test failed: {operation}"
        elif operation["op"] == "add" and isinstance(parent, list):
            parent.insert(last, operation["value"])
        elif operation["op"] == "add":
            parent[last] = operation["value"]
        else:
            raise ValueError(f"operation {operation['op']!r} is not implemented here")
    return out


def test_json_patch_adds_appends_escapes_and_tests():
    doc = {"a": [{"b": 1}], "c": {}}
    patched = json_patch(
        doc,
        [
            {"op": "test", "path": "/a/0/b", "value": 1},
            {"op": "add", "path": "/a/-", "value": 2},
            {"op": "add", "path": "/c/x~1y", "value": "3"},
        ],
    )
    assert patched == {"a": [{"b": 1}, 2], "c": {"x/y": "3"}} and doc["c"] == {}
    with pytest.raises(AssertionError, match="test failed"):
        json_patch(doc, [{"op": "test", "path": "/a/0/b", "value": 2}])


def rdma_patched_rayjob() -> dict:
    component = yaml.safe_load((RDMA_COMPONENT / "kustomization.yaml").read_text())
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert component["kind"] == "Component"
    job = one("RayJob")
    [patch] = component["patches"]
    assert patch["target"] == {
        "group": "ray.io",
        "version": "v1",
        "kind": "RayJob",
        "name": job["metadata"]["name"],
    }
    return json_patch(job, yaml.safe_load((RDMA_COMPONENT / patch["path"]).read_text()))


def gpu_worker(job: dict) -> dict:
    [group] = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    [container] = group["template"]["spec"]["containers"]
    return container


def test_the_rdma_component_gives_the_gpu_workers_rdma_and_the_base_stays_on_tcp():
    job = rdma_patched_rayjob()
    assert not validation_errors(job)
    worker = gpu_worker(job)
    resources = worker["resources"]
    assert resources["requests"][RDMA_RESOURCE] == resources["limits"][RDMA_RESOURCE] == "1"
    # No capability: NCCL needs a locked-memory limit, not IPC_LOCK (docs/deployment.md, "RDMA").
    assert worker["securityContext"] == gpu_worker(one("RayJob"))["securityContext"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["NCCL_NET"] == "IB"
    # NCCL's bootstrap and Gloo stay on the pod network.
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    # Only the GPU workers' Ray container changes.
    base = one("RayJob")
    rest = copy.deepcopy(job)
    [group] = rest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    group["template"]["spec"]["containers"] = [gpu_worker(base)]
    assert rest == base
    # The base asks for no RDMA and lists no component.
    base_worker = gpu_worker(base)
    assert not any(name.startswith("rdma/") for name in base_worker["resources"]["limits"])
    assert "NCCL_NET" not in {e["name"] for e in base_worker["env"]}
    assert "components" not in yaml.safe_load((K8S / "kustomization.yaml").read_text())


def test_kustomize_renders_the_rdma_component_as_the_test_patches_it(tmp_path):
    [job] = [doc for doc in kustomize(tmp_path, ("rdma",)) if doc["kind"] == "RayJob"]
    expected = rdma_patched_rayjob()
    # The build also applies the site settings (the image's registry); compare the rest.
    for docs in (job, expected):
        for template in built_pod_templates(docs).values():
            for container in all_containers(template["spec"]):
                container["image"] = container["image"].rpartition("/")[2]
    assert job == expected


def test_readme_names_every_manifest_and_component():
    readme = (K8S / "README.md").read_text()
    for path in MANIFEST_FILES:
        assert str(path.relative_to(K8S)) in readme, path
    for name in component_names():
        assert f"components/{name}" in readme, name
    assert re.search(r"kubectl apply -k k8s", readme)
    assert OWNER_STEP in (ROOT / "docs" / "deployment.md").read_text()


def test_every_ray_pod_ends_a_dead_workers_process_group():
    """A generator replica that dies must take vLLM's engine processes, and their GPU memory,
    with it (tests/test_replica_exit.py): the raylet of every pod runs with per-worker process
    groups, in the RayCluster and in the RayJob's cluster alike."""
    clusters = {"RayCluster": one("RayCluster")["spec"]}
    clusters["RayJob"] = one("RayJob")["spec"]["rayClusterSpec"]
    for kind, spec in clusters.items():
        for group, template in pod_templates(spec).items():
            for container in template["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in container["env"]}
                assert env.get("RAY_process_group_cleanup_enabled") == "1", (kind, group)


# ----------------------------------------------------------------- authentication, stopping


def ray_containers(spec: dict) -> dict[str, dict]:
    return {g: t["spec"]["containers"][0] for g, t in pod_templates(spec).items()}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_token_authentication_is_on_in_both_manifests():
    """KubeRay's authOptions (Ray >= 2.52) put RAY_AUTH_MODE=token and the Secret's token into
    every Ray container and the submitter; nothing here may switch it off."""
    for kind in ("RayJob", "RayCluster"):
        doc = one(kind)
        spec = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
        assert spec["authOptions"] == {"mode": "token"}, kind
        assert tuple(map(int, spec["rayVersion"].split("."))) >= (2, 52), kind
        for group, container in ray_containers(spec).items():
            env = env_of(container)
            assert "RAY_AUTH_MODE" not in env and "RAY_AUTH_TOKEN" not in env, (kind, group)


def test_the_network_policy_admits_the_run_the_operator_and_monitoring_only():
    policy = one("NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    selector = policy["podSelector"]
    for kind in ("RayJob", "RayCluster"):
        doc = one(kind)
        spec = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
        for template in pod_templates(spec).values():
            assert labels_select(selector, template["metadata"]["labels"])
    assert labels_select(
        selector, one("RayJob")["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    )
    own, operator, monitoring = policy["ingress"]
    assert own == {"from": [{"podSelector": selector}]}
    [peer] = operator["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    assert set(peer["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    [peer] = monitoring["from"]
    assert set(peer["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}
    # Neither Ray Client nor the GCS is open outside the run.
    outside = {p["port"] for rule in (operator, monitoring) for p in rule["ports"]}
    assert not outside & {6379, 10001}


def test_every_ray_pod_stops_the_job_before_ray_stops():
    """The preStop hook runs deploy/stop_ray_jobs.py, which the image holds at that path
    (tests/test_token_auth.py runs it against a real Ray head with token authentication)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    for kind in ("RayJob", "RayCluster"):
        doc = one(kind)
        spec = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
        for group, template in pod_templates(spec).items():
            [container] = template["spec"]["containers"]
            command = container["lifecycle"]["preStop"]["exec"]["command"]
            assert command == ["python", "/app/deploy/stop_ray_jobs.py"], (kind, group)
            assert template["spec"]["terminationGracePeriodSeconds"] == GRACE_S, (kind, group)
        head_env = env_of(ray_containers(spec)["head"])
        # Ray's job supervisor waits this long after SIGTERM before SIGKILL; it must leave
        # Ray itself time to stop inside the grace period.
        stop_wait = int(head_env["RAY_JOB_STOP_WAIT_TIME_S"]["value"])
        assert STEP_S + CHECKPOINT_S <= stop_wait <= GRACE_S - 30
    assert (ROOT / "deploy" / "stop_ray_jobs.py").exists()
    assert "COPY deploy/stop_ray_jobs.py /app/deploy/" in dockerfile


# The 7B recipe's checkpoint, from the planner's parameter count: bf16 weights (2 bytes) and
# the fp32 master weights and two AdamW moments (12 bytes) that DeepSpeed saves per parameter.
CHECKPOINT_BYTES_PER_PARAMETER = 2 + 12
# Stated estimates, not measurements (docs/deployment.md, "Stopping with a checkpoint"): the
# aggregate write rate of a ReadWriteMany volume (NFS, Filestore, EFS: a few hundred MB/s),
# and the longest step of the 7B recipe on 16 GPUs that the grace period must let finish.
WRITE_BYTES_PER_S = 250e6
STEP_S = 300
GRACE_S = 900
CHECKPOINT_S = 450


def test_the_grace_period_covers_a_step_and_a_checkpoint_of_the_7b_recipe():
    from cagrpo_ray.plan.shapes import model_shape

    config = load_config(
        [ROOT / "configs" / "async.yaml", ROOT / "configs" / "gpu-7b-multinode.yaml"]
    )
    parameters = model_shape(config.model.path).parameters()
    checkpoint_bytes = parameters * CHECKPOINT_BYTES_PER_PARAMETER
    assert 100e9 < checkpoint_bytes < 115e9  # "about 110 GB" in the recipe's own comment
    assert checkpoint_bytes / WRITE_BYTES_PER_S <= CHECKPOINT_S
    assert STEP_S + CHECKPOINT_S + 60 <= GRACE_S - 60


def test_the_hugging_face_token_is_optional_and_on_the_head_only():
    for kind in ("RayJob", "RayCluster"):
        doc = one(kind)
        spec = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
        containers = ray_containers(spec)
        token = env_of(containers.pop("head"))["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token["optional"] is True and token["name"] and token["key"]
        for group, container in containers.items():
            assert "HF_TOKEN" not in env_of(container), (kind, group)
    job = one("RayJob")["spec"]
    assert "HF_TOKEN" not in job["entrypoint"]
    assert "HF_TOKEN" not in str(job["submitterPodTemplate"])


def test_the_submitter_is_kuberays_and_submits_the_entrypoint():
    job = one("RayJob")["spec"]
    template = job["submitterPodTemplate"]
    [container] = template["spec"]["containers"]
    assert container["image"].startswith("quay.io/kuberay/submitter:")
    assert container["command"] == ["/submitter"]
    assert container["args"][0] == "--"
    assert container["args"][1:] == shlex.split(job["entrypoint"])
    assert template["spec"]["restartPolicy"] == "Never"
    assert container["resources"]["limits"]["memory"].endswith("Mi")


def test_a_job_that_never_starts_ends():
    job = one("RayJob")["spec"]
    assert 0 < job["preRunningDeadlineSeconds"] <= 3600
    assert job["activeDeadlineSeconds"] > job["preRunningDeadlineSeconds"]
