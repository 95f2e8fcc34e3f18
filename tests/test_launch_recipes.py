"""The multi-node launch recipes under examples/ parse and use only fields their tools know."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# The RayJob (ray.io/v1) fields the manifest may use, from KubeRay's CRD: unknown keys are typos that the
# API server would reject or silently drop.
RAYJOB_SPEC = {
    "entrypoint",
    "runtimeEnvYAML",
    "jobId",
    "shutdownAfterJobFinishes",
    "ttlSecondsAfterFinished",
    "activeDeadlineSeconds",
    "rayClusterSpec",
    "clusterSelector",
    "submitterPodTemplate",
    "suspend",
    "submissionMode",
    "entrypointNumCpus",
    "entrypointNumGpus",
    "entrypointResources",
}
CLUSTER_SPEC = {
    "rayVersion",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headGroupSpec",
    "workerGroupSpecs",
    "headServiceAnnotations",
    "suspend",
}
HEAD_SPEC = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
WORKER_SPEC = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "rayStartParams",
    "template",
    "numOfHosts",
    "scaleStrategy",
    "suspend",
    "idleTimeoutSeconds",
}


def test_kuberay_rayjob_manifest() -> None:
    doc = yaml.safe_load((EXAMPLES / "kuberay" / "rayjob.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob" and doc["metadata"]["name"]
    spec = doc["spec"]
    assert set(spec) <= RAYJOB_SPEC, set(spec) - RAYJOB_SPEC
    assert spec["entrypoint"].startswith("roll-train ") and "cluster.address=auto" in spec["entrypoint"]
    cluster = spec["rayClusterSpec"]
    assert set(cluster) <= CLUSTER_SPEC and set(cluster["headGroupSpec"]) <= HEAD_SPEC
    assert all(isinstance(v, str) for v in cluster["headGroupSpec"]["rayStartParams"].values())
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= WORKER_SPEC, set(group) - WORKER_SPEC
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for pod in (group["template"], cluster["headGroupSpec"]["template"]):
            for c in pod["spec"]["containers"]:
                assert c["image"] and c["name"]
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                assert mounts <= {v["name"] for v in pod["spec"].get("volumes", [])}


def test_entrypoint_overrides_compose() -> None:
    from roll_core.config import compose

    entry = yaml.safe_load((EXAMPLES / "kuberay" / "rayjob.yaml").read_text())["spec"]["entrypoint"]
    overrides = entry.split()[1:]
    cfg = compose(overrides)
    assert cfg.cluster.address == "auto" and cfg.train_engine.world_size == 4


def test_slurm_script_is_valid_bash_and_starts_a_cluster() -> None:
    script = EXAMPLES / "slurm" / "roll.sbatch"
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash not found")
    subprocess.run([bash, "-n", str(script)], check=True)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "#SBATCH --nodes=" in text
    assert "ray start --head" in text and 'ray start --address="$head_ip:$port"' in text
    assert 'roll-train cluster=ray cluster.address="$head_ip:$port"' in text
