"""Resources and pod hygiene: requests and limits, Guaranteed shards sized by their caps, GPUs,
the images per overlay, the restricted Pod Security Standard."""

from __future__ import annotations

import pytest

from cgx_ps.server.process.sizing import shard_memory_mib

from .dockerfiles import split_image
from .kubelet import parse_quantity
from .manifests import GPU, RENDER_DIRS, all_containers, config, container, shard_sts, worker_job, workloads


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_every_container_requests_cpu_and_memory(rel):
    for w in workloads(rel):
        for c in all_containers(w):
            requests = c.get("resources", {}).get("requests", {})
            assert "cpu" in requests and "memory" in requests, f"{w['kind']}/{c['name']}"
            if "memory" in c["resources"].get("limits", {}):
                assert parse_quantity(requests["memory"]) <= parse_quantity(c["resources"]["limits"]["memory"])


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_shards_are_guaranteed_qos(rel):
    sts = shard_sts(rel)
    for c in all_containers(sts):
        res = c["resources"]
        assert set(res["requests"]) == {"cpu", "memory"}
        assert res["requests"] == res["limits"], c["name"]
    # The memory limit covers the shard's caps by the measured rule (benchmarks/shard_memory.py).
    mem_mib = parse_quantity(container(sts, "shard")["resources"]["limits"]["memory"]) / 2**20
    cfg = config(rel)
    need = shard_memory_mib(float(cfg["CGX_PS_MAX_INFLIGHT_MB"]), float(cfg["CGX_PS_MAX_MODEL_MB"]),
                            cfg["CGX_PS_ERROR_FEEDBACK"] not in ("", "0", "false"),
                            int(cfg["CGX_PS_MAX_CONCURRENT_RPCS"]))
    assert mem_mib >= need, f"{rel}: shard memory limit {mem_mib:.0f} MiB < {need:.0f} MiB its caps need"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_gpus_only_in_limits(rel):
    for w in workloads(rel):
        for c in all_containers(w):
            res = c.get("resources", {})
            assert GPU not in res.get("requests", {}), f"{w['kind']}/{c['name']}: GPUs in requests"
    for c in all_containers(shard_sts(rel)):
        assert GPU not in c["resources"].get("limits", {}), "shards sum on the CPU"
    limits = container(worker_job(rel), "worker")["resources"].get("limits", {})
    if rel == "overlays/gpu":
        assert limits[GPU] == int(config(rel)["GPUS_PER_NODE"])
    else:
        assert GPU not in limits


def test_gpu_overlay_uses_the_gpu_image_for_workers_only():
    job = worker_job("overlays/gpu")
    for c in all_containers(job):
        assert split_image(c["image"])[0].endswith("/cgx-ps-gpu")
    for c in all_containers(shard_sts("overlays/gpu")):
        assert split_image(c["image"])[0].endswith("/cgx-ps")
    for rel in ("base", "overlays/cpu-local"):
        for w in workloads(rel):
            for c in all_containers(w):
                assert split_image(c["image"])[0] == "cgx-ps"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_pods_meet_the_restricted_pod_security_standard(rel):
    for w in workloads(rel):
        pod = w["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 1) != 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for v in pod.get("volumes", []):
            assert set(v) - {"name"} <= {"emptyDir", "configMap", "secret", "projected",
                                          "persistentVolumeClaim", "downwardAPI", "ephemeral"}
        for c in all_containers(w):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), c["name"]
            assert not sc.get("privileged"), c["name"]
