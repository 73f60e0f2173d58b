"""py-spy on one worker process of a 2-rank job, by thread: where its communication (or any)
thread spends its samples, native frames included (what ``procstat.ThreadCpu``'s system part
cannot name: a ``munmap`` of a large tensor freed on that thread, a copy, a syscall).

    .venv/bin/python benchmarks/worker_profile.py [--front-end "DDP + cgx-ps hook 4bit"] [--steps 80]
        [--delay 15] [--seconds 10] [--thread cgx-comm] [--top 15]

Starts 2 shards (``LocalCluster``) and the two ranks of the front end (``worker.FRONT_ENDS``: the
optimizer's ``cgx_step.py`` or the DDP hook's ``ddp_step.py``, mlp17m, one thread), waits
``--delay`` seconds (start-up and warm-up steps), records rank 0 for ``--seconds`` with
``py-spy record --threads --native --format raw``, lets the job finish, and prints the thread's
busy samples (idle waits dropped: epoll, condition variables) by leaf frame, by the innermost
frame of this project's code in the stack, and by both, with their shares.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/worker_profile.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.worker import FRONT_ENDS, _free_port  # noqa: E402
from cgx_ps.server import LocalCluster  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
PY_SPY = Path(sys.executable).with_name("py-spy")
IDLE = re.compile(r"epoll_wait|pthread_cond_(timed)?wait|futex|select \(|_worker \(concurrent|wait \(threading|"
                  r"poll \(|sem_(timed)?wait|run_forever|_run_once \(asyncio")


def busy_samples(raw: str, thread: str) -> list[tuple[list[str], int]]:
    """(frames root first, count) of the stacks of threads named ``thread*`` whose leaf is not idle."""
    out = []
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if thread not in frames[0]:
            continue
        if any(IDLE.search(f) for f in frames[-2:]):  # a wait (the GIL's too: a cond wait inside libc)
            continue
        out.append((frames[1:], int(count)))
    return out


def table(title: str, counts: collections.Counter, total: int, top: int) -> None:
    print(f"\n| {title} | samples | share of busy |\n|---|---:|---:|")
    for name, n in counts.most_common(top):
        print(f"| `{name[:110]}` | {n} | {n / total:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--front-end", default="DDP + cgx-ps hook 4bit", choices=list(FRONT_ENDS))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--delay", type=float, default=15.0)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--thread", default="cgx-comm", help="thread name (prefix) to report")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--raw", default=None, help="keep py-spy's raw stacks here")
    args = parser.parse_args()
    script, *flags = FRONT_ENDS[args.front_end]
    argv = [sys.executable, str(HERE / "benchmarks" / script), "--model", "mlp17m", "--steps", str(args.steps),
            "--warmup", "3", "--threads", "1", *flags]
    job, port = uuid.uuid4().hex[:8], str(_free_port())
    with LocalCluster(2, extra_args=["--log-level", "WARNING"]) as cluster, tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE), **cluster.worker_env(), CGX_PS_JOB_ID=job,
                   WORLD_SIZE="2", CGX_PS_NUM_NODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "CGX_PS_NODE_RANK": str(r)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
        try:
            time.sleep(args.delay)
            out = Path(tmp) / "raw.txt"
            spy = subprocess.run([str(PY_SPY), "record", "--pid", str(procs[0].pid), "--threads", "--native", "-r",
                                  "100", "-d", str(args.seconds), "--format", "raw", "-o", str(out)],
                                 capture_output=True, text=True)
            if spy.returncode:
                raise SystemExit(f"py-spy failed ({spy.returncode}): {spy.stderr[-2000:]}")
            raw = out.read_text()
            if args.raw:
                Path(args.raw).write_text(raw)
            for proc in procs:
                proc.wait(timeout=600)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    samples = busy_samples(raw, args.thread)
    total = sum(n for _, n in samples)
    print(f"{args.front_end}, rank 0, {args.seconds:g} s at 100 Hz: {total} busy samples of threads {args.thread}*")
    if not total:
        print("threads seen:", sorted({line.split(";")[0] for line in raw.splitlines()}))
        return
    leaves, ours, pairs = collections.Counter(), collections.Counter(), collections.Counter()
    for frames, n in samples:
        leaves[frames[-1]] += n
        own = [f for f in frames if "cgx_ps" in f]
        ours[own[-1] if own else "(no cgx_ps frame)"] += n
        pairs[f"{own[-1] if own else '-'} <- {frames[-1]}"] += n
    table("leaf frame", leaves, total, args.top)
    table("innermost cgx_ps frame", ours, total, args.top)
    table("innermost cgx_ps frame <- leaf frame", pairs, total, args.top)


if __name__ == "__main__":
    main()
