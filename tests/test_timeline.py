"""The timeline (cgx_ps/timeline/): a real 2-worker job against 2 shards, each process writing a
Chrome trace, read back and checked for content, step range, nesting, order and one clock; and
the step range and event cap on their own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from cgx_ps import cli, timeline
from cgx_ps.server.config import ServerConfig
from cgx_ps.worker import ConfigError
from support import env_for, wait_until_stopped
from workers.warm_start import start_worker

ROOT = Path(__file__).resolve().parents[1]

WORKER_SPANS = {"step", "backward-ready", "exposed wait", "write-back", "optimizer",  # training thread
                "encode", "decode",  # codec threads
                "block", "push", "wait", "pull"}  # the block's track
SHARD_SPANS = {"receive", "sum", "re-encode", "send"}
RECORDED = range(1, 3)  # CGX_PS_TIMELINE_STEPS=1:3 of steps 0..3


def spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def nesting_errors(trace: dict) -> list[str]:
    """Spans on one row (thread or track) must nest: each starts after its predecessor ended or
    lies within it (1 ns of slack for the µs floats)."""
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for e in spans(trace):
        rows[e["pid"], e["tid"]].append(e)
    errors = []
    for row in rows.values():
        open_: list[dict] = []
        for e in sorted(row, key=lambda e: (e["ts"], -e["dur"])):
            while open_ and e["ts"] >= open_[-1]["ts"] + open_[-1]["dur"] - 1e-3:
                open_.pop()
            if open_ and e["ts"] + e["dur"] > open_[-1]["ts"] + open_[-1]["dur"] + 1e-3:
                errors.append(f"{e['name']} {e['args']} overlaps {open_[-1]['name']} {open_[-1]['args']}")
            open_.append(e)
    return errors


@pytest.mark.slow
def test_a_two_worker_job_traces_every_process_on_one_clock(tmp_path, local_cluster):
    template = str(tmp_path / "trace.json")
    job = {"CGX_PS_JOB_ID": f"tl-{uuid.uuid4().hex[:8]}", "CGX_PS_TIMELINE": template, "CGX_PS_TIMELINE_STEPS": "1:3"}
    cluster = local_cluster(2, round_timeout=30, extra_args=["--kernel-threads", "1", "--timeline", template,
                                                          "--timeline-steps", "1:3"])
    # rank 0 trains 4 steps and ends normally; rank 1 stops itself before a 5th step and is
    # then killed with SIGTERM, as torchrun stops the workers of a failed job
    procs = [start_worker([sys.executable, str(ROOT / "tests/workers/step_worker.py"), "--out",
                           str(tmp_path / f"rank{r}.pt"), *args],
                          env=env_for(r, 2, cluster.addresses, **job), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
             for r, args in enumerate([["--steps", "4"], ["--steps", "5", "--stall-at-step", "4"]])]
    try:
        out, err = procs[0].communicate(timeout=240)
        assert procs[0].returncode == 0, err[-3000:]
        wait_until_stopped(procs[1].pid, 60)
        procs[1].send_signal(signal.SIGTERM)
        procs[1].send_signal(signal.SIGCONT)
        _, err = procs[1].communicate(timeout=60)
        assert procs[1].returncode == -signal.SIGTERM, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    cluster.stop()  # the shards write theirs when they stop
    workers = [timeline.load(str(tmp_path / f"trace.rank{r}.json")) for r in range(2)]
    shards = [timeline.load(str(tmp_path / f"trace.shard{i}.json")) for i in range(2)]

    for trace, expected in [(t, WORKER_SPANS) for t in workers] + [(t, SHARD_SPANS) for t in shards]:
        events = spans(trace)
        assert trace["otherData"]["dropped_events"] == 0 and trace["otherData"]["steps"] == "1:3"
        assert {e["args"]["step"] for e in events} == set(RECORDED)  # none outside the range
        for step in RECORDED:
            assert expected <= {e["name"] for e in events if e["args"]["step"] == step}, step
        assert nesting_errors(trace) == []
        names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert any(n.startswith("block ") or n.endswith(" receive") for n in names), names
    assert len({t["traceEvents"][0]["pid"] for t in workers + shards}) == 4

    # within a block and step, on each worker: encode, push, wait, pull, decode, write-back in turn
    windows: dict[tuple[int, int], list[float]] = {}  # (block, step) -> [first push, last pull]
    for trace in workers:
        by = defaultdict(dict)
        for e in spans(trace):
            if "block" in e["args"]:
                by[e["args"]["block"], e["args"]["step"]][e["name"]] = e
        assert len(by) == 2 * len({b for b, _ in by}), "every block in both steps"
        for (block, step), phase in by.items():
            order = [phase[n] for n in ("backward-ready", "encode", "push", "wait", "pull", "decode", "write-back")]
            for before, after in zip(order, order[1:]):
                assert before["ts"] + before["dur"] <= after["ts"] + 1e-3, (block, step, before, after)
            assert phase["block"]["ts"] <= phase["encode"]["ts"] and \
                phase["decode"]["ts"] + phase["decode"]["dur"] <= phase["block"]["ts"] + phase["block"]["dur"] + 1e-3
            pull_end = phase["pull"]["ts"] + phase["pull"]["dur"]
            w = windows.setdefault((block, step), [phase["push"]["ts"], pull_end])
            w[0], w[1] = min(w[0], phase["push"]["ts"]), max(w[1], pull_end)

    # the shards' work on a block lies inside the workers' push..pull window of that block: one clock
    seen = set()
    for trace in shards:
        for e in spans(trace):
            first_push, last_pull = windows[e["args"]["block"], e["args"]["step"]]
            assert first_push <= e["ts"] <= last_pull, e
            if e["name"] != "send":  # a write is reported done after the worker may have read it
                assert e["ts"] + e["dur"] <= last_pull, e
            seen.add((e["args"]["block"], e["args"]["step"]))
    assert seen == set(windows)  # every block of every recorded step went through a shard


def test_step_ranges_parse_or_are_refused_by_name(tmp_path):
    assert [timeline.parse_steps(s) for s in ("", "3", "10:20", ":5", "4:", " 2 : 9 ")] == [
        timeline.StepRange(0, None), timeline.StepRange(3, 4), timeline.StepRange(10, 20), timeline.StepRange(0, 5),
        timeline.StepRange(4, None), timeline.StepRange(2, 9)]
    assert 19 in timeline.StepRange(10, 20) and 20 not in timeline.StepRange(10, 20) and 9 not in timeline.StepRange(10)
    env = {"CGX_PS_TIMELINE": str(tmp_path / "t.json")}
    for bad, why in [("x", "is not a step range"), ("-1:4", "is not a step range"), ("1:2:3", "is not a step range"),
                     ("5:5", "selects no step"), ("7:3", "selects no step")]:
        with pytest.raises(ConfigError, match=f"CGX_PS_TIMELINE_STEPS='{bad}' {why}"):
            timeline.start_from_env({**env, "CGX_PS_TIMELINE_STEPS": bad}, "rank", 0, "worker", error=ConfigError)
    with pytest.raises(ConfigError, match="not a writable directory"):
        timeline.start_from_env({"CGX_PS_TIMELINE": str(tmp_path / "missing" / "t.json")}, "rank", 0, "worker",
                                error=ConfigError)
    with pytest.raises(ValueError, match=r"--timeline-steps \(CGX_PS_TIMELINE_STEPS\)='three' is not a step range"):
        ServerConfig.from_env({"CGX_PS_TIMELINE_STEPS": "three"})
    args = cli.build_parser().parse_args(["server", "--timeline", "t.json", "--timeline-steps", "2:4"])
    assert ServerConfig.from_flags(vars(args)).timeline_steps == "2:4"
    assert timeline.trace_path("/x/trace.json", "rank", 3) == "/x/trace.rank3.json"
    assert timeline.trace_path("/x/trace", "shard", 1) == "/x/trace.shard1.json"


def test_the_ring_buffer_keeps_the_newest_events_and_counts_the_rest(tmp_path):
    rec = timeline.Recorder(str(tmp_path / "t.json"), "worker rank 0", steps=timeline.StepRange(2, 5), max_events=4)
    assert timeline.span("encode", 3) is timeline.span("push", 3, "block 0")  # off: one shared no-op
    assert timeline.start(rec) is rec
    try:
        for step in range(8):
            with timeline.span("encode", step, block=step):
                timeline.since(timeline.mark(), "push", step, timeline.block_track(0), block=step)
    finally:
        assert timeline.stop() == rec.path and timeline.stop() is None
    trace = timeline.load(rec.path)
    kept = [(e["name"], e["args"]["step"]) for e in spans(trace)]
    assert sorted(kept) == [("encode", 3), ("encode", 4), ("push", 3), ("push", 4)]  # steps 2..4, newest 4
    assert trace["otherData"]["recorded_events"] == 6 and trace["otherData"]["dropped_events"] == 2
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] in ("thread_name", "process_name")}
    assert {"worker rank 0", "block 0"} <= names  # names survive the ring
    assert nesting_errors(trace) == []
    merged = tmp_path / "merged.json"
    assert timeline.main([str(merged), rec.path, rec.path]) == 0
    assert len(json.loads(merged.read_text())["traceEvents"]) == 2 * len(trace["traceEvents"])


def test_the_clock_is_the_hosts_clock_monotonic():
    # every process on the host reads this clock: worker and shard files line up
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    now = timeline.now_ns()
    assert before <= now <= time.clock_gettime_ns(time.CLOCK_MONOTONIC)
