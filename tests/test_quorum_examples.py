"""The example scripts under quorum rounds, as a user runs them: a node SIGSTOPped several times
mid-run (and once more as the others end) catches up, and every node ends at the same step, with
bit-identical parameters, and exits 0 — none is left pushing rounds no other node takes part in."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from support import env_for, free_port

NODES, STALLED = 3, 2
EXAMPLES = {"optimizer": "cgx_ps.examples.train", "ddp hook": "cgx_ps.examples.ddp_train"}


class Progress:
    """Rank 0's step events (``--json``), read as they come."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.step, self.total, self.lines = 0, 0, []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)
            if line.startswith("{"):
                event = json.loads(line)
                if event["event"] == "step":
                    self.step, self.total = event["step"], event["total_steps"]

    def wait_for(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.step < step and self._thread.is_alive():
            assert time.monotonic() < deadline, f"rank 0 at step {self.step}, waited for {step}"
            time.sleep(0.005)

    def done(self, timeout: float) -> dict:
        self._thread.join(timeout)
        return json.loads(next(line for line in self.lines if '"done"' in line))


def start_nodes(cluster, module: str, extra_env: dict[str, str]) -> list[subprocess.Popen]:
    job = dict(CGX_PS_JOB_ID=f"qexample-{uuid.uuid4().hex[:8]}", CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20",
               **extra_env)
    args = ["--data", "synthetic", "--epochs", "30", "--hidden", "128", "--compression", "4bit", "--json"]
    return [subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env_for(r, NODES, cluster.addresses, **job))
            for r in range(NODES)]


def pause(proc: subprocess.Popen, seconds: float) -> None:
    proc.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    proc.send_signal(signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.parametrize("front_end", EXAMPLES)
def test_the_example_under_a_quorum_ends_on_every_node_after_a_stalled_node_caught_up(local_cluster, front_end):
    cluster = local_cluster(2, round_timeout=20)
    gloo = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())) if front_end == "ddp hook" else {}
    procs = start_nodes(cluster, EXAMPLES[front_end], gloo)
    try:
        progress = Progress(procs[0])
        for at in (30, 120, 210):  # a few of the others' rounds each (~6 ms): far fewer than the 16 a shard keeps
            progress.wait_for(at)
            pause(procs[STALLED], 0.025)
        progress.wait_for(progress.total - 3)  # and once as the others end
        pause(procs[STALLED], 0.3)
        outs = [proc.communicate(timeout=120) for proc in procs[1:]]  # (stdout, stderr)
        procs[0].wait(timeout=120)
        errs = [procs[0].stderr.read()] + [err for _, err in outs]
        for rank, proc in enumerate(procs):  # a node that failed says why before its output is read
            assert proc.returncode == 0, f"rank {rank} exit {proc.returncode}:\n{errs[rank][-4000:]}"
        summaries = [progress.done(timeout=30)] + [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    finally:
        for proc in procs:
            proc.kill()
    total = progress.total
    assert [s["steps"] for s in summaries] == [total] * NODES, summaries
    assert len({s["param_sha256"] for s in summaries}) == 1, summaries  # replicas bit-identical
    computed = [s["computed_steps"] for s in summaries]  # the stalled node caught up: it computed fewer
    assert computed[STALLED] < total and computed[STALLED] < min(computed[:STALLED]), computed
