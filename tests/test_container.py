"""The image, run: two shard and two worker containers on a user-defined Docker network.

- `cgx-ps status` from a third container sees both shards serving;
- the example training job finishes with bit-identical replicas, and a shard container killed
  (SIGKILL) mid-training and started again is survived: the workers rejoin it and end with the
  same parameters as an uninterrupted run of the same job (no step lost or applied twice).

Needs a Docker daemon and a built image: scripts/container_test.sh builds one (offline, with
cached base image and wheelhouse) and runs this file with CGX_PS_TEST_IMAGE set; without it every
test here is skipped. The containers authenticate with a job token mounted from a file, as a user
would run them on a shared network.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from test_prebuilt_kernels import PROBE

IMAGE = os.environ.get("CGX_PS_TEST_IMAGE", "")
# Optional: a volume (or host directory) every container mounts as its numba kernel cache. Unset in
# CI, so that each container starts as a new pod does and loads the image's prebuilt kernels.
NUMBA_CACHE = os.environ.get("CGX_PS_TEST_NUMBA_CACHE", "")
TOKEN_IN_CONTAINER = "/run/secrets/cgx-ps/token"
IMAGE_UID = 10001  # deploy/Dockerfile's USER
EPOCHS = 30  # 22 steps an epoch at the example's defaults: long enough to kill a shard mid-job
STEPS = EPOCHS * 22

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(not IMAGE, reason="needs Docker and a built image: run scripts/container_test.sh"),
]


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def started_at(container: str) -> datetime:
    return parse_time(docker("inspect", "-f", "{{.State.StartedAt}}", container).stdout.strip())


def parse_time(stamp: str) -> datetime:
    """Docker's RFC 3339 time with nanoseconds, to the microsecond datetime keeps."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00")


@dataclass
class Network:
    """A user-defined network with the job's token file; containers on it reach the shards by
    their aliases shard-0 and shard-1."""

    name: str
    token_file: Path
    containers: list[str]

    def run(self, name: str, *args: str, env: dict[str, str] | None = None, entrypoint: str | None = None,
            alias: str | None = None, detach: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        full = f"{self.name}-{name}"
        options = ["--name", full, "--network", self.name,
                   "-v", f"{self.token_file}:{TOKEN_IN_CONTAINER}:ro",
                   "-e", f"CGX_PS_TOKEN_FILE={TOKEN_IN_CONTAINER}",
                   "-e", "CGX_PS_SERVERS=shard-{i}:7070", "-e", "CGX_PS_NUM_SHARDS=2"]
        if NUMBA_CACHE:
            options += ["-v", f"{NUMBA_CACHE}:/tmp/numba-cache"]
        for key, value in (env or {}).items():
            options += ["-e", f"{key}={value}"]
        if alias:
            options += ["--network-alias", alias]
        if entrypoint:
            options += ["--entrypoint", entrypoint]
        self.containers.append(full)
        return docker("run", "-d" if detach else "--rm", *options, IMAGE, *args, timeout=timeout)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A one-off `cgx-ps ...` in a third container on the network."""
        return self.run(f"cli-{uuid.uuid4().hex[:6]}", *args, detach=False, timeout=timeout)

    def start_shard(self, i: int) -> None:
        # One kernel thread: four containers share the host's cores.
        self.run(f"shard-{i}", "server", "--kernel-threads", "1", alias=f"shard-{i}",
                 env={"CGX_PS_SHARD_INDEX": str(i)})

    def start_workers(self, job: str) -> list[str]:
        """The two nodes of one job, as the Kubernetes Job runs them: torchrun, one rank each."""
        names = []
        for rank in range(2):
            self.run(f"{job}-node-{rank}", "--standalone", "--nproc-per-node=1", "/app/examples/train.py",
                     "--data", "synthetic", "--epochs", str(EPOCHS), "--json", entrypoint="torchrun",
                     # A recovery timeout above the default: the restarted shard's container
                     # competes for the cores with three others.
                     env={"CGX_PS_NUM_NODES": "2", "CGX_PS_NODE_RANK": str(rank), "CGX_PS_JOB_ID": job,
                          "CGX_PS_RECOVERY_TIMEOUT": "120"})
            names.append(f"{self.name}-{job}-node-{rank}")
        return names

    def status(self) -> dict:
        out = self.cli("status", "--json", "--sample", "0")
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Network]:
    name = f"cgx-ps-test-{uuid.uuid4().hex[:8]}"
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    # Readable by the image's user only: what a user does with the file they mount.
    if os.geteuid() == 0:
        os.chown(token_file, IMAGE_UID, IMAGE_UID)
        token_file.chmod(0o400)
    else:
        token_file.chmod(0o444)
    docker("network", "create", name)
    net = Network(name, token_file, [])
    try:
        yield net
    finally:
        for container in net.containers:
            docker("rm", "-f", container, check=False)
        docker("network", "rm", name, check=False)


@pytest.fixture(scope="module")
def shards(network: Network) -> Network:
    # One after the other: with an empty kernel cache the first compiles the kernels and the
    # second loads them, where two at once would compile them twice on the same cores.
    for i in range(2):
        began = time.monotonic()
        network.start_shard(i)
        network.cli("wait-for-shards", "--servers", f"shard-{i}:7070", "--num-shards", "1",
                    "--interval", "0.5", "--timeout", "300", timeout=330)
        print(f"\ncontainer test: shard {i} serving {time.monotonic() - began:.1f} s after its container started")
    return network


def logs(container: str) -> str:
    out = docker("logs", container)
    return out.stdout + out.stderr


def wait_for_step(container: str, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in docker("logs", container).stdout.splitlines():
            if line.startswith("{") and json.loads(line).get("step", 0) >= step:
                return
        if docker("inspect", "-f", "{{.State.Running}}", container).stdout.strip() != "true":
            raise AssertionError(f"{container} stopped before step {step}:\n{logs(container)[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{container} did not reach step {step} in {timeout_s} s:\n{logs(container)[-3000:]}")


def finish(workers: list[str], timeout_s: float = 300) -> list[dict]:
    """Each worker's final summary, once every one exited 0."""
    codes = docker("wait", *workers, timeout=timeout_s).stdout.split()
    everything = "\n".join(f"{w} (exit {c}):\n{logs(w)[-3000:]}" for w, c in zip(workers, codes))
    assert codes == ["0"] * len(workers), everything
    summaries = []
    for w in workers:
        done = [json.loads(line) for line in docker("logs", w).stdout.splitlines()
                if line.startswith('{"event": "done"')]
        assert len(done) == 1, everything
        summaries.append(done[0])
    return summaries


def first_step_after_start(worker: str) -> float:
    """Seconds from the container's start to its first training step's line (rank 0 prints one
    per step)."""
    for line in docker("logs", "-t", worker).stdout.splitlines():
        stamp, _, text = line.partition(" ")
        if text.startswith('{"event": "step"'):
            return (parse_time(stamp) - started_at(worker)).total_seconds()
    raise AssertionError(f"{worker}: no step line:\n{logs(worker)[-3000:]}")


def test_the_images_prebuilt_kernels_are_loaded_not_compiled(network: Network) -> None:
    """A fresh container (empty NUMBA_CACHE_DIR) copies the image's prebuilt kernels in and
    compiles none: the image was built on this machine, so they were compiled for its CPU."""
    if NUMBA_CACHE:
        pytest.skip("the containers share a kernel cache volume (CGX_PS_TEST_NUMBA_CACHE)")
    out = network.run("kernels", "-c", PROBE, entrypoint="python", detach=False)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["status"] == "copied" and report["files"] > 0, (report, out.stderr[-2000:])
    assert report["misses"] == 0 and report["hits"] >= 4, report


def test_status_from_a_third_container_sees_both_shards(shards: Network) -> None:
    report = shards.status()
    assert report["ok"], report
    assert [s["shard"] for s in report["shards"]] == [0, 1]
    for i, shard in enumerate(report["shards"]):
        assert shard["health"] == "SERVING", shard
        assert shard["status"]["shard_index"] == i and shard["status"]["num_shards"] == 2, shard


def test_a_killed_and_restarted_shard_container_is_survived_exactly(shards: Network) -> None:
    reference = finish(shards.start_workers("uninterrupted"))
    print(f"container test: rank 0's first step {first_step_after_start(f'{shards.name}-uninterrupted-node-0'):.1f} s "
          f"after its container started")
    assert [r["param_sha256"] for r in reference] == [reference[0]["param_sha256"]] * 2  # replicas identical
    assert [r["steps"] for r in reference] == [STEPS, STEPS]
    assert reference[0]["accuracy"] > 0.9, reference  # it trained, not just agreed
    before = {s["shard"]: s["status"]["instance_id"] for s in shards.status()["shards"]}

    workers = shards.start_workers("restarted")
    wait_for_step(workers[0], 40, timeout_s=240)
    shard_1 = f"{shards.name}-shard-1"
    docker("kill", shard_1)  # SIGKILL: rounds in flight are lost with it
    docker("wait", shard_1)
    time.sleep(1.0)
    killed_at = time.monotonic()
    docker("start", shard_1)  # the same container: same alias on the network, a new shard process
    results = finish(workers)
    print(f"container test: job finished {time.monotonic() - killed_at:.1f} s after the shard container restarted")

    for worker in workers:
        assert "rejoined the restarted shard" in logs(worker), logs(worker)[-3000:]
    assert [r["steps"] for r in results] == [STEPS, STEPS]
    # Both replicas, and the same parameters as the uninterrupted run: every step applied once.
    assert [r["param_sha256"] for r in results] == [reference[0]["param_sha256"]] * 2, (results, reference)
    after = {s["shard"]: s["status"] for s in shards.status()["shards"]}
    assert after[1]["instance_id"] != before[1] and after[0]["instance_id"] == before[0], (before, after)
    assert after[0]["job_id"] == after[1]["job_id"] == "restarted", after
    assert after[0]["rounds_completed"] == STEPS, after[0]  # shard 0 saw the whole job
