"""docker/k8s/mpijob.yaml, validated as far as anything can be without a cluster: the MPIJob against the
MPI Operator's v2beta1 API (kubeflow.org/v2beta1: MPIJobSpec, RunPolicy, SchedulingPolicy and
kubeflow/common's ReplicaSpec, written here from the operator's Go types), its pod templates and the
PersistentVolumeClaim against Kubernetes' own schemas (kubernetes-validate's, strict: an unknown field
fails), and the command the launcher runs against the job's own numbers."""
import json
import re
from importlib import resources

import jsonschema
import pytest
import referencing
import yaml

from jobs import ROOT

kubernetes_validate = pytest.importorskip("kubernetes_validate")
MANIFEST = ROOT / "docker" / "k8s" / "mpijob.yaml"
K8S = "1.29.0"  # the Kubernetes version whose schemas the pod templates are checked against


def _int32(minimum=0):
    return {"type": "integer", "minimum": minimum, "maximum": 2**31 - 1}


def _object(properties, required=()):
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"  # kubernetes-validate's definitions, by their $id
POD_TEMPLATE = {"$ref": DEFS + "io.k8s.api.core.v1.PodTemplateSpec"}
REPLICA_SPEC = _object({"replicas": _int32(), "template": POD_TEMPLATE,
                        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]}}, ["template"])
MPIJOB_V2BETA1 = _object({
    "apiVersion": {"const": "kubeflow.org/v2beta1"},
    "kind": {"const": "MPIJob"},
    "metadata": {"$ref": DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
    "spec": _object({
        "slotsPerWorker": _int32(1),
        "runPolicy": _object({
            "cleanPodPolicy": {"enum": ["None", "Running", "All"]},
            "ttlSecondsAfterFinished": _int32(), "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
            "backoffLimit": _int32(), "suspend": {"type": "boolean"},
            "schedulingPolicy": _object({"minAvailable": _int32(), "queue": {"type": "string"},
                                         "minResources": {"type": "object"}, "priorityClass": {"type": "string"},
                                         "scheduleTimeoutSeconds": _int32()})}),
        "mpiReplicaSpecs": _object({"Launcher": REPLICA_SPEC, "Worker": REPLICA_SPEC}, ["Launcher"]),
        "sshAuthMountPath": {"type": "string"},
        "waitForWorkers": {"type": "boolean"},  # v0.4; v0.5 and later: launcherCreationPolicy
        "launcherCreationPolicy": {"enum": ["AtStartup", "WaitForWorkersReady"]},
        "mpiImplementation": {"enum": ["OpenMPI", "Intel", "MPICH"]},
    }, ["mpiReplicaSpecs"]),
}, ["apiVersion", "kind", "metadata", "spec"])


def _validate_mpijob(doc):
    """The MPIJob schema above, its pod templates resolved in Kubernetes' strict definitions."""
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S}-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry = referencing.Registry().with_resource(
        definitions["$id"], referencing.jsonschema.DRAFT202012.create_resource(definitions))
    jsonschema.Draft202012Validator(MPIJOB_V2BETA1, registry=registry).validate(doc)


@pytest.fixture(scope="module")
def docs():
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_the_mpijob_is_a_valid_kubeflow_v2beta1_mpijob_with_valid_pod_templates(docs):
    assert set(docs) == {"MPIJob", "PersistentVolumeClaim"}
    _validate_mpijob(docs["MPIJob"])


def test_the_persistent_volume_claim_is_valid_for_kubernetes(docs):
    kubernetes_validate.validate(docs["PersistentVolumeClaim"], K8S, strict=True)


def test_the_validation_catches_a_misspelt_field_in_the_job_and_in_a_pod_template(docs):
    """Not a schema that accepts anything: a wrong field fails at either level."""
    bad = yaml.safe_load(yaml.safe_dump(docs["MPIJob"]))
    bad["spec"]["slotsPerWorkers"] = 4
    with pytest.raises(jsonschema.ValidationError, match="slotsPerWorkers"):
        _validate_mpijob(bad)
    bad = yaml.safe_load(yaml.safe_dump(docs["MPIJob"]))
    bad["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError, match="volumeMount"):
        _validate_mpijob(bad)


def test_the_launcher_starts_one_rank_per_slot_on_the_workers_and_mounts_what_they_mount(docs):
    spec = docs["MPIJob"]["spec"]
    launcher, worker = (spec["mpiReplicaSpecs"][k] for k in ("Launcher", "Worker"))
    assert launcher["replicas"] == 1
    script = launcher["template"]["spec"]["containers"][0]["args"][0]
    np_ = int(re.search(r"horovodrun -np (\d+)", script).group(1))
    assert np_ == worker["replicas"] * spec["slotsPerWorker"]
    assert "--hostfile /etc/mpi/hostfile" in script and "python -m hvdtrain" in script
    claims = {v["persistentVolumeClaim"]["claimName"] for r in (launcher, worker)
              for v in r["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {docs["PersistentVolumeClaim"]["metadata"]["name"]}
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
