"""Where a shard's event loop spends its samples, from a py-spy raw profile (``--threads --native
--format raw``: one line per stack, ``frame;frame;... count``, the thread first).

    python -m benchmarks.loopprofile PROFILE.txt [...]

Each sample of the main thread goes to one kind of work, decided by its innermost Python frame and
its native leaf (first match wins, in the order of KINDS). benchmarks/dataplane.py prints this
for each shard it profiled (``--profile``).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

__all__ = ["KINDS", "kind_of", "loop_split"]

_WAITS = ("epoll_pwait", "epoll_wait")  # the loop idle, waiting for sockets or the executor
_SYSCALLS = ("send", "sendmsg", "recv", "recvmsg", "read", "write", "epoll_ctl", "ioctl")
WAITING = "waiting in epoll (idle)"
# (kind, test on (innermost Python frame, native leaf))
KINDS = (
    (WAITING, lambda py, leaf: leaf.split(" ")[0] in _WAITS),
    ("socket system calls", lambda py, leaf: leaf.split(" ")[0] in _SYSCALLS),
    # gRPC copies each message between its slices and Python bytes: under the read, and under
    # NodeStream's write (where the raw plane's frames go down to rawplane.py instead)
    ("gRPC's message copies", lambda py, leaf: "next_message" in py or "cygrpc" in py
     or ("stream.py" in py and "libc" in leaf)),
    ("kernels and crc on the loop", lambda py, leaf: "cgx_ps/kernels" in py),
    ("the raw plane's Python", lambda py, leaf: "rawplane.py" in py),
    ("handing work to the executor", lambda py, leaf: "concurrent/futures" in py or "threading.py" in py),
    ("service, assembler, aggregator, stream (cgx_ps)", lambda py, leaf: "cgx_ps/" in py),
    ("event loop machinery (uvloop, asyncio)", lambda py, leaf: True),
)


def kind_of(frames: list[str]) -> str:
    """The kind of work of one stack (its frames outermost first, the thread's name excluded)."""
    python = [f for f in frames if ".py:" in f]
    innermost = python[-1] if python else ""
    leaf = frames[-1] if frames else ""
    return next(kind for kind, test in KINDS if test(innermost, leaf))


def loop_split(path: str | Path) -> tuple[int, Counter]:
    """(the main thread's samples, their count by kind) in a py-spy raw profile."""
    kinds: Counter = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or "MainThread" not in frames[0]:
            continue
        total += int(count)
        kinds[kind_of(frames[1:])] += int(count)
    return total, kinds


def main(paths: list[str]) -> None:
    """Each profile's split, as shares of the loop's busy samples (py-spy counts a thread blocked
    in epoll as active when it samples native frames)."""
    for path in paths:
        if not Path(path).exists():  # py-spy interrupted before its first sample writes nothing
            print(f"{path}: no profile (py-spy wrote none: it was stopped before it attached, or could not attach)")
            continue
        total, kinds = loop_split(path)
        busy = total - kinds.pop(WAITING, 0)
        print(f"{path}: {busy} busy samples of the event loop ({total - busy} more waiting in epoll)")
        for kind, n in kinds.most_common():
            print(f"  {100 * n / max(busy, 1):5.1f}%  {kind}")


if __name__ == "__main__":
    usage = f"usage: python -m benchmarks.loopprofile PROFILE.txt [...]\n\n{__doc__}"
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(usage)
    elif not sys.argv[1:]:
        sys.exit(usage)
    else:
        main(sys.argv[1:])
