"""Fuzz a real shard over every RPC with generated, mutated and garbage messages.

The run: start the shard, check a legitimate 2-node round, send the cases CONCURRENCY at a
time, then check the shard (alive, SERVING, another legitimate round, RSS, log, statuses) and
stop it; ``main`` is the command line (``python -m tests.shard_fuzzer``)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgx_ps.kernels import Codec, dequantize, encode
from cgx_ps.net.security import ChannelSecurity, new_token_file, read_token
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

from .calls import call
from .cases import Case, case_rng, make_cases, metadata_for, plan_for
from .report import FuzzReport
from .settings import CONCURRENCY, RSS_ALLOWANCE_MIB, SERVICE
from .shard import HealthWatch, InProcessShard, RssSampler, SubprocessShard
from .shard_log import analyse_log
from .world import World

async def legitimate_round(address: str, token_file: str, job: str) -> str | None:
    """Two nodes with the token complete a round and get identical bytes, the sum; None if so."""
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    security = ChannelSecurity(token_file=token_file)
    clients = [ShardClient(address, f"node-{i}", 2, layout, connect_timeout_s=20, job_id=job, security=security)
               for i in range(2)]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.connect() for c in clients)), 30)
        values = [torch.full((4096,), float(i + 1)) for i in range(2)]
        payloads = [encode(v, Codec.FP32).to_bytes() for v in values]
        results = await asyncio.wait_for(asyncio.gather(*(c.exchange(0, 0, p) for c, p in zip(clients, payloads))), 30)
        if results[0] != results[1]:
            return "the two nodes got different results"
        if not torch.equal(dequantize(results[0]), values[0] + values[1]):
            return "the result is not the sum"
        return None
    except Exception as exc:  # noqa: BLE001 - the report says what went wrong
        return f"{type(exc).__name__}: {exc}"
    finally:
        for c in clients:
            await c.close()


async def health_serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for service in ("", SERVICE):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    return False
        except grpc.aio.AioRpcError:
            return False
    return True


async def run_case(case: Case, seed: int, world: World, channels: Channels, token: str,
                   report: FuzzReport) -> None:
    rng = case_rng(seed, case.index)
    try:
        metadata = metadata_for(case.kind, rng, token)
        right = metadata_for("member", rng, token)
        who = await world.join(channels.aio, right) if case.kind == "member" and case.method != "Register" \
            else world.stranger(rng)
        plan = plan_for(case, rng, world, who)
        loop = asyncio.get_running_loop()
        outcome = await asyncio.wait_for(
            loop.run_in_executor(channels.threads, call, channels.blocking, case.method, plan, metadata),
            plan.deadline + 10)
        report.record(case, plan.scenario, outcome)
        if outcome.code == "OK" and plan.on_ok is not None:
            plan.on_ok()
    except asyncio.TimeoutError:
        report.fuzzer_errors += 1
        report.alarm(case, case.scenario, "the call outlived its deadline by 10 s")
    except Exception as exc:  # noqa: BLE001 - a fuzzer bug must not stop the run; it is reported
        report.fuzzer_errors += 1
        report.alarm(case, case.scenario, f"fuzzer error {type(exc).__name__}: {exc}")


@dataclass
class Channels:
    aio: grpc.aio.Channel  # the members' own Registers
    blocking: grpc.Channel  # the fuzz calls (see call())
    threads: ThreadPoolExecutor


async def run_cases(cases: list[Case], seed: int, world: World, address: str, token: str,
                    report: FuzzReport) -> None:
    """All cases, CONCURRENCY at a time; each call's deadline bounds how long it can take."""
    options = [("grpc.max_send_message_length", 64 << 20)]  # so over-limit messages reach the shard
    channels = Channels(grpc.aio.insecure_channel(address), grpc.insecure_channel(address, options=options),
                        ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="fuzz-call"))
    try:
        slots = asyncio.Semaphore(CONCURRENCY)
        running: set[asyncio.Task] = set()
        for case in cases:
            await slots.acquire()
            task = asyncio.ensure_future(run_case(case, seed, world, channels, token, report))
            task.add_done_callback(lambda _t: slots.release())
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
    finally:
        channels.threads.shutdown(wait=True)
        channels.blocking.close()
        await channels.aio.close()


async def fuzz(cases: int, seed: int, shard, token_file: str, mode: str) -> FuzzReport:
    report = FuzzReport(cases, seed, mode)
    token = read_token(token_file)
    await shard.start()
    try:
        report.exchange_before = await legitimate_round(shard.address, token_file, "before-fuzz")
        await asyncio.sleep(0.5)  # let the warm-up's allocations settle before the baseline
        report.rss_start_kib = report.rss_end_kib = shard.rss_kib()
        report.rss_bound_kib = report.rss_start_kib + RSS_ALLOWANCE_MIB * 1024
        log_start = len(shard.log_lines())
        world = World(seed)
        t0 = time.monotonic()
        with RssSampler(shard) as sampler, HealthWatch(shard.address) as watch:
            await run_cases(make_cases(cases, seed), seed, world, shard.address, token, report)
            report.seconds = time.monotonic() - t0
            await asyncio.sleep(1.0)  # lines the last calls cause, and memory they free
        report.rss_peak_kib, report.rss_quarter_peaks_kib = sampler.peak_kib, sampler.quarter_peaks_kib()
        report.health_worst_s = watch.worst_s
        report.register_failures, report.members_not_joined = world.register_failures, world.not_joined
        report.bad_calls["Register"] += sum(world.register_failures.values())  # failed calls too: they may log
        report.alive = shard.alive()
        if report.alive:
            report.rss_end_kib = shard.rss_kib()
            report.log = analyse_log(shard.log_lines()[log_start:])
            report.serving = await health_serving(shard.address)
            report.exchange_after = await legitimate_round(shard.address, token_file, "after-fuzz")
    finally:
        report.exit_code = await shard.stop()
    return report


def run_fuzz(cases: int, seed: int = 0, subprocess: bool = True, keep_log: str | None = None) -> FuzzReport:
    """Fuzz a fresh shard with ``cases`` calls; the report says what happened and ``problems()``
    lists the properties that did not hold (empty: all did)."""
    with tempfile.TemporaryDirectory(prefix="cgx-ps-fuzz-") as tmp:
        workdir = Path(tmp)
        token_file = new_token_file(workdir)
        shard = (SubprocessShard if subprocess else InProcessShard)(workdir, token_file)
        try:
            return asyncio.run(fuzz(cases, seed, shard, token_file, "subprocess" if subprocess else "in-process"))
        finally:
            if keep_log and shard.log_path.exists():
                Path(keep_log).write_bytes(shard.log_path.read_bytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.shard_fuzzer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="calls to send (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--subprocess", dest="subprocess", action="store_true", default=True,
                       help="run the shard as its own process (the default: its RSS and log are its own)")
    where.add_argument("--in-process", dest="subprocess", action="store_false",
                       help="run the shard in this process (debugging; RSS includes the fuzzer)")
    parser.add_argument("--keep-log", metavar="FILE", help="copy the shard's log here")
    args = parser.parse_args(argv)
    report = run_fuzz(args.cases, args.seed, subprocess=args.subprocess, keep_log=args.keep_log)
    print(report.summary())
    return 1 if report.problems() else 0
