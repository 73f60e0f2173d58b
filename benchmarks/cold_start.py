"""Start-up with empty kernel caches (a new venv, container or pod), before and after in one run.

    .venv/bin/python benchmarks/cold_start.py [--before-ref REF] [--numel 4000000] [--repeats 5] [--json out.json]

"Before" is the tree at ``--before-ref`` (git archive into a temporary folder, run with it first on
PYTHONPATH): its shard compiled every kernel of every width before it served. "After" is this
checkout. Every process gets an empty ``NUMBA_CACHE_DIR`` (numba then neither reads nor writes
the in-tree caches). Per tree:

1. shard and worker started together (one node, ``cgx_ps.examples.train``, 4-bit): seconds from
   the shard's start to it serving (its port file), and to the worker's first completed step (the
   shard has served the first round);
2. a second worker, cold too, on the same shard (now warm): seconds from its start to its first
   completed compressed step.

3. Codec speed (the two kernel packages imported side by side in this process, one thread each,
   ops interleaved, best of ``--repeats``): 4-bit quantize, dequantize, dequantize-accumulate, and a shard's sum of
   two pushes re-encoded (EncodedSum), at ``--numel`` elements.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

if __name__ == "__main__" and not __package__:  # `python benchmarks/cold_start.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.procstat import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the last commit whose CPU kernels covered every bit width in one compile, warmed before serving
BEFORE_REF = "a3e31de"


def _export(ref: str, into: Path) -> Path:
    """The tree at ``ref``, extracted under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "cgx_ps"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tree: Path, tmp: Path, **extra: str) -> dict[str, str]:
    cache = Path(tempfile.mkdtemp(prefix="numba-", dir=tmp))  # empty: nothing compiled yet
    return dict(os.environ, PYTHONPATH=str(tree), NUMBA_CACHE_DIR=str(cache), **extra)


def _worker(tree: Path, tmp: Path, port: int, job: str) -> subprocess.Popen:
    env = _env(tree, tmp, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", CGX_PS_NODE_RANK="0",
               CGX_PS_NUM_NODES="1", CGX_PS_SERVERS=f"127.0.0.1:{port}", CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1",
               CGX_PS_CONNECT_TIMEOUT="600")
    return subprocess.Popen([sys.executable, "-m", "cgx_ps.examples.train", "--json", "--epochs", "1",
                             "--data", "synthetic", "--hidden", "256", "--compression", "4bit"],
                            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _first_step(worker: subprocess.Popen, started: float, timeout_s: float = 600.0) -> float:
    """Seconds from ``started`` to the worker's first completed step; the worker then runs to its end."""
    deadline = time.monotonic() + timeout_s
    for line in worker.stdout:
        if line.startswith("{") and json.loads(line).get("event") == "step":
            at = time.monotonic() - started
            worker.stdout.read()
            worker.wait(timeout=max(1.0, deadline - time.monotonic()))
            return at
    raise RuntimeError(f"the worker exited with code {worker.wait()} before its first step")


def cold_start(tree: Path, tmp: Path) -> dict:
    port = _free_port()
    port_file = tmp / f"shard-{port}.json"
    started = time.monotonic()
    shard = subprocess.Popen([sys.executable, "-m", "cgx_ps.cli", "server", "--host", "127.0.0.1", "--port", str(port),
                              "--metrics-port", "-1", "--port-file", str(port_file)],
                             env=_env(tree, tmp), cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        worker = _worker(tree, tmp, port, "cold-1")
        while not port_file.exists():
            if shard.poll() is not None:
                raise RuntimeError(f"the shard exited with code {shard.returncode}")
            time.sleep(0.02)
        serving = time.monotonic() - started
        first_round = _first_step(worker, started)
        second = time.monotonic()
        worker_first_step = _first_step(_worker(tree, tmp, port, "cold-2"), second)
    finally:
        shard.terminate()
        shard.wait(timeout=60)
    return {"shard_serving_s": serving, "shard_first_round_s": first_round, "worker_first_step_s": worker_first_step}


def _load_kernels(tree: Path, name: str):
    """``cgx_ps.kernels`` of ``tree`` as the package ``name`` (it imports nothing else of cgx_ps)."""
    folder = tree / "cgx_ps" / "kernels"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def codec_speed(trees: dict[str, Path], numel: int, repeats: int) -> list[dict]:
    kernels = {label: _load_kernels(tree, f"{label}_kernels") for label, tree in trees.items()}
    for k in kernels.values():  # one thread: the kernels' speed, not how a loaded machine schedules a pool
        k.cpu.set_num_threads(1)
    x = torch.randn(numel)
    y = torch.empty_like(x)

    def ops(k) -> dict[str, Callable[[], object]]:
        block = k.quantize(x, 4, 1024, stochastic=True, seed=1)
        payload = block.to_bytes()

        def summed() -> None:
            total = k.EncodedSum(numel, parts=2)
            total.add(payload)
            total.add(payload)
            total.encode(k.Codec.MAXMIN, bits=4, bucket_size=1024, stochastic=True, seed=2)

        return {"quantize 4-bit stochastic": lambda: k.quantize(x, 4, 1024, stochastic=True, seed=1),
                "quantize 4-bit nearest": lambda: k.quantize(x, 4, 1024),
                "dequantize 4-bit": lambda: k.dequantize(block, out=y),
                "dequantize-accumulate 4-bit": lambda: k.dequantize(block, out=y, accumulate=True),
                "sum of 2 pushes, re-encoded 4-bit": summed}

    table = {label: ops(k) for label, k in kernels.items()}
    best = {(label, op): float("inf") for label in table for op in table[label]}
    for fns in table.values():  # compile (or load) and fault in
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for op in table["after"]:
            for label in table:  # interleaved: a load that comes and goes hits both alike
                t0 = time.perf_counter()
                table[label][op]()
                best[label, op] = min(best[label, op], time.perf_counter() - t0)
    return [{"op": op, "before_ms": best["before", op] * 1e3, "after_ms": best["after", op] * 1e3,
             "after_over_before": best["after", op] / best["before", op]} for op in table["after"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before-ref", default=BEFORE_REF, help="git revision of the 'before' tree (default %(default)s)")
    p.add_argument("--numel", type=int, default=4_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-codec", action="store_true", help="cold starts only")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="cold-start-") as scratch:
        tmp = Path(scratch)
        trees = {"before": _export(args.before_ref, Path(tempfile.mkdtemp(dir=tmp))), "after": ROOT}
        result: dict = {"before_ref": args.before_ref, "cpu": cpu_model(), "cold_start": {}}
        for label, tree in trees.items():
            result["cold_start"][label] = row = cold_start(tree, tmp)
            print(f"{label:6s}  shard serving {row['shard_serving_s']:5.1f} s  first round served "
                  f"{row['shard_first_round_s']:5.1f} s  cold worker's first step {row['worker_first_step_s']:5.1f} s",
                  flush=True)
        if not args.skip_codec:
            os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(dir=tmp)
            result["codec"] = codec_speed(trees, args.numel, args.repeats)
            for r in result["codec"]:
                print(f"{r['op']:36s} before {r['before_ms']:7.2f} ms  after {r['after_ms']:7.2f} ms  "
                      f"after/before {r['after_over_before']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
