"""Start-up of the container image with an empty kernel cache, with and without its prebuilt kernels.

    .venv/bin/python benchmarks/cold_start_image.py --image cgx-ps:container-test [--repeats 3] [--json out.json]

The image compiles every width's CPU kernels while it is built (``CGX_PS_KERNEL_CACHE``,
``cgx_ps/kernels/prebuilt.py``). Each trial starts, on a fresh user-defined network, a shard
container and a one-node worker container at once (``cgx_ps/examples/train.py``, 4-bit, one
epoch), neither with a kernel cache volume, as a new pod starts. "prebuilt" runs the image as
built; "compiled" the same image with ``CGX_PS_KERNEL_CACHE`` empty, so each process compiles its
kernels as an image without them would. The two alternate, so a load that comes and goes hits
both. Per trial, from Docker's own timestamps:

- the shard serving: its "serving on" log line, from its container's start;
- the first step: the worker's first step line (the shard has served the first round), from the
  shard container's start.

Needs a Docker daemon and a built image (``scripts/container_test.sh`` or ``deploy/build-offline.sh``).
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/cold_start_image.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.procstat import cpu_model  # noqa: E402

TOKEN = "/run/secrets/cgx-ps/token"
MODES = {"prebuilt": {}, "compiled": {"CGX_PS_KERNEL_CACHE": ""}}


def docker(*args: str, timeout: float = 300) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ...: {out.stderr.strip()[-2000:]}")
    return out.stdout


def _time(stamp: str) -> datetime:
    """Docker's RFC 3339 time (nanoseconds) to a datetime (microseconds)."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00")


def _started(container: str) -> datetime:
    return _time(docker("inspect", "-f", "{{.State.StartedAt}}", container).strip())


def _first_line(container: str, marker: str) -> datetime:
    out = subprocess.run(["docker", "logs", "-t", container], capture_output=True, text=True, timeout=60)
    for line in sorted((out.stdout + out.stderr).splitlines()):  # the stamps sort as text
        stamp, _, text = line.partition(" ")
        if marker in text:
            return _time(stamp)
    raise RuntimeError(f"{container}: no line with {marker!r}")


def _collect(container: str) -> str:
    out = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    return out.stdout + out.stderr


def trial(image: str, token: Path, env: dict[str, str]) -> dict[str, float]:
    net = f"cgx-cold-{uuid.uuid4().hex[:8]}"
    shard, worker = f"{net}-shard", f"{net}-node"
    common = ["--network", net, "-v", f"{token}:{TOKEN}:ro", "-e", f"CGX_PS_TOKEN_FILE={TOKEN}"]
    for key, value in env.items():
        common += ["-e", f"{key}={value}"]
    docker("network", "create", net)
    try:
        docker("run", "-d", "--name", shard, "--network-alias", "shard-0", *common, "-e", "CGX_PS_SHARD_INDEX=0",
               image, "server")
        docker("run", "-d", "--name", worker, *common, "-e", "CGX_PS_SERVERS=shard-0:7070", "-e", "CGX_PS_NUM_SHARDS=1",
               "-e", "CGX_PS_NUM_NODES=1", "-e", "CGX_PS_NODE_RANK=0", "-e", f"CGX_PS_JOB_ID={net}",
               "--entrypoint", "torchrun", image, "--standalone", "--nproc-per-node=1", "/app/examples/train.py",
               "--data", "synthetic", "--epochs", "1", "--json")
        code = docker("wait", worker, timeout=600).strip()
        if code != "0":
            raise RuntimeError(f"worker exited {code}:\n{_collect(worker)[-3000:]}")
        t0 = _started(shard)
        return {"shard_serving_s": (_first_line(shard, "serving on") - t0).total_seconds(),
                "first_step_s": (_first_line(worker, '{"event": "step"') - t0).total_seconds(),
                "worker_start_lag_s": (_started(worker) - t0).total_seconds()}
    finally:
        subprocess.run(["docker", "rm", "-f", shard, worker], capture_output=True)
        subprocess.run(["docker", "network", "rm", net], capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--image", required=True, help="a built cgx-ps image")
    p.add_argument("--repeats", type=int, default=3, help="trials per mode, alternating (default %(default)s)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="cold-image-") as scratch:
        token = Path(scratch) / "token"
        token.write_text(secrets.token_urlsafe(32) + "\n")
        token.chmod(0o444)
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode, env in MODES.items():
                row = trial(args.image, token, env)
                rows[mode].append(row)
                print(f"{mode:9s} shard serving {row['shard_serving_s']:5.1f} s  "
                      f"first step {row['first_step_s']:5.1f} s", flush=True)
                time.sleep(1.0)
    summary = {mode: {key: statistics.median(r[key] for r in got) for key in got[0]} for mode, got in rows.items()}
    for mode, med in summary.items():
        print(f"median {mode:9s} shard serving {med['shard_serving_s']:5.1f} s  first step {med['first_step_s']:5.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"image": args.image, "cpu": cpu_model(), "trials": rows,
                                         "median": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
