"""Shard restarts: how fast training resumes, what it costs when nothing fails, and what it changes.

    .venv/bin/python benchmarks/recovery.py [--steps-before 60] [--down-s 1] [--ab-pairs 40] [--json out.json]

1. Resume: 2 workers train cgx_ps/examples/train.py (MLP, synthetic digits-shaped data, 4-bit)
   on 2 shards; shard ``--kill-shard`` is SIGKILLed after ``--steps-before`` steps and started again on its port ``--down-s`` later.
   Reported: seconds from the new shard serving (its port file is written after it starts
   serving) to the first step rank 0 completes after that, and the final test loss and parameter
   checksum against an uninterrupted run of the same job (without shard-side error feedback the
   two must be bit-identical; with it, the residuals the shard loses change the run a little).
2. Bookkeeping: one node exchanging a 4M-parameter layout (4-bit, 1 MiB blocks) with one shard
   process, alternating step by step (ABBA) between the client with its recovery bookkeeping (kept
   pushes and results, the supervisor) and the same client with pushes and results handled as
   before recovery existed. Reported: median step time of each, their ratio, and the median
   ratio of neighbouring steps (less exposed to a shared machine's drifting load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from cgx_ps.kernels import Codec, encode
from cgx_ps.server import LocalCluster
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.shards.exchange_stream import ExchangeStream
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

ROOT = Path(__file__).resolve().parents[1]


# ---- 1. resume after a restart ------------------------------------------------------------------

def _train(cluster: LocalCluster, servers: list[str], kill_after: int | None, down_s: float, kill: int = 0) -> dict:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    procs = []
    for r in range(2):
        env = dict(os.environ, **cluster.worker_env())
        env.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", CGX_PS_NODE_RANK=str(r),
                   CGX_PS_NUM_NODES="2", CGX_PS_SERVERS=",".join(servers), CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "cgx_ps.examples.train", "--json", "--epochs", "3",
                                       "--data", "synthetic", "--hidden", "256"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    lines: queue.Queue = queue.Queue()

    def read(i: int) -> None:
        for line in procs[i].stdout:
            lines.put((time.monotonic(), i, json.loads(line)))

    for i in range(2):
        threading.Thread(target=read, args=(i,), daemon=True).start()
    out: dict = {"done": {}}
    serving_at = None
    while len(out["done"]) < 2:
        at, rank, event = lines.get(timeout=300)
        if event["event"] == "done":
            out["done"][rank] = event
        elif kill_after is not None and serving_at is None and event["step"] >= kill_after:
            cluster.procs[kill].kill()
            cluster.procs[kill].wait()
            time.sleep(down_s)
            cluster.restart(kill)
            serving_at = time.monotonic()
        elif serving_at is not None and at > serving_at and "resume_s" not in out:
            out["resume_s"] = at - serving_at
            out["resumed_at_step"] = event["step"]
    for p in procs:
        p.wait(timeout=60)
        if p.returncode:
            raise RuntimeError(f"worker failed: {p.stderr.read()[-2000:]}")
    return out


def resume(args: argparse.Namespace, shard_ef: bool) -> dict:
    extra = ["--log-level", "WARNING", *(["--error-feedback"] if shard_ef else [])]
    with LocalCluster(2, extra_args=extra) as cluster:
        plain = _train(cluster, cluster.addresses, None, 0)
        hit = _train(cluster, cluster.addresses, args.steps_before, args.down_s, args.kill_shard)
    a, b = plain["done"][0], hit["done"][0]
    return {"shard_error_feedback": shard_ef, "resume_s": hit.get("resume_s"), "steps": a["steps"],
            "killed_shard": args.kill_shard, "killed_after_step": args.steps_before,
            "test_loss_uninterrupted": a["test_loss"], "test_loss_restarted": b["test_loss"],
            "accuracy_uninterrupted": a["accuracy"], "accuracy_restarted": b["accuracy"],
            "replicas_identical": hit["done"][0]["param_sha256"] == hit["done"][1]["param_sha256"],
            "bit_identical_to_uninterrupted": a["param_sha256"] == b["param_sha256"]}


# ---- 2. bookkeeping cost ------------------------------------------------------------------------

class _SwitchableStream(ExchangeStream):
    """The exchange stream, with its recovery bookkeeping switchable per step (``bookkeeping =
    False``: pushes and results are handled as by the client before recovery existed)."""

    bookkeeping = True

    async def push(self, block_id: int, round_: int, payload: bytes) -> None:
        if self.bookkeeping:
            return await super().push(block_id, round_, payload)
        async with self._write_lock:
            await self._write(block_id, round_, payload)
        self.bytes_sent += len(payload)

    def _take(self, chunk: ps_pb2.PullChunk) -> None:
        if self.bookkeeping:
            return super()._take(chunk)
        key = (chunk.block_id, chunk.round)
        parts = self._incoming.setdefault(key, [])
        parts.append(chunk.data)
        if chunk.offset + len(chunk.data) >= chunk.total_bytes:
            del self._incoming[key]
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            self.bytes_received += len(data)
            future = self._waiting.pop(key, None)
            if future is not None and not future.done():
                future.set_result(data)


class _Switchable(ShardClient):
    stream_type = _SwitchableStream


async def _ab(address: str, token_env: dict, pairs: int) -> dict:
    from cgx_ps.net.security import ChannelSecurity
    tensors = [TensorInfo(f"layer{i}.weight", (1024, 1024)) for i in range(4)]
    layout = build_layout(tensors, 1, Compression(bits=4, bucket_size=1024), block_bytes=1 << 20)
    client = _Switchable(address, "node-0", 1, layout, connect_timeout_s=30, job_id=f"ab-{uuid.uuid4().hex[:6]}",
                         security=ChannelSecurity.from_env(token_env), recovery_timeout_s=60)
    payloads = {b.block_id: encode(torch.randn(b.numel), Codec.MAXMIN, bits=4, bucket_size=1024).to_bytes()
                for b in layout.blocks}
    times: dict[bool, list[float]] = {True: [], False: []}
    round_ = 0
    try:
        await client.connect()
        for i in range(2 * (pairs + 2)):
            client.stream.bookkeeping = on = (i % 4) in (0, 3)  # ABBA: neither goes first more often
            t0 = time.perf_counter()
            await asyncio.gather(*[client.exchange(b, round_, p) for b, p in payloads.items()])
            if i >= 4:  # the first steps warm the shard's kernels and the connection
                times[on].append(time.perf_counter() - t0)
            round_ += 1
    finally:
        await client.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    pairs_ratio = statistics.median(a / b for a, b in zip(times[True], times[False]))  # neighbours in time
    return {"blocks": len(layout.blocks), "bytes_per_step": sum(map(len, payloads.values())), "pairs": pairs,
            "median_step_ms_bookkeeping": on * 1e3, "median_step_ms_baseline": off * 1e3,
            "ratio_of_medians": on / off, "median_of_pair_ratios": pairs_ratio}


def bookkeeping(args: argparse.Namespace) -> dict:
    with LocalCluster(1, extra_args=["--log-level", "WARNING"]) as cluster:
        return asyncio.run(_ab(cluster.addresses[0], cluster.worker_env(), args.ab_pairs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps-before", type=int, default=60, help="steps before shard 1 is killed")
    p.add_argument("--kill-shard", type=int, default=0,
                   help="the shard to restart (0 owns the model's one quantized block: its residuals matter)")
    p.add_argument("--down-s", type=float, default=1.0, help="seconds between the kill and the restart")
    p.add_argument("--ab-pairs", type=int, default=40, help="interleaved step pairs for the bookkeeping cost")
    p.add_argument("--only", choices=["bookkeeping", "resume"], help="run one part")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    results = {}
    if args.only != "resume":
        results["bookkeeping"] = bookkeeping(args)
    if args.only != "bookkeeping":
        results["resume"] = [resume(args, ef) for ef in (False, True)]
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
