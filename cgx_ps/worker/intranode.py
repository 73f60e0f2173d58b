"""Intra-node reduction through POSIX shared memory: one compressed push per node.

The local ranks of a node each map one segment per rank (``/dev/shm``) holding every block's
float32 buffer plus per-block flags. Blocks are split among the local ranks (balanced by wire
bytes); for each block, its owner waits until every local rank has written its gradient, sums
them, and is the only one of the node to compress and push it (a reduce-scatter). After the pull
the owner publishes the decoded result and the others copy it (an all-gather). So every block
leaves the node exactly once and the compression work is spread over the node's ranks.

Segments are unlinked as soon as every rank has mapped them, so nothing is left in /dev/shm
even if a process is killed later. A local rank that dies or stalls makes the others fail
within the timeout with an error that names it.

Flags are written after the data they announce; x86-64's store order (TSO) makes that enough
for another process to see the data once it sees the flag.
"""

from __future__ import annotations

import asyncio
import heapq
import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..layout import block_payload_size
from ..v1 import ps_pb2
from .errors import CgxPsError

__all__ = ["NodeReducer", "IntraNodeError", "assign_owners", "SHM_DIR"]

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
_HEADER_WORDS = 8  # [0] magic, [1] pid, [2] attached, rest reserved
_MAGIC = 0x43475850534E4F44  # "CGXPSNOD"


class IntraNodeError(CgxPsError):
    """A local rank of this node died, stalled or disagreed."""


def assign_owners(layout: ps_pb2.Layout, local_world_size: int) -> list[int]:
    """Owner local rank of every block: longest-processing-time greedy on wire bytes."""
    loads = [(0, r) for r in range(local_world_size)]
    heapq.heapify(loads)
    owners = [0] * len(layout.blocks)
    for block in sorted(layout.blocks, key=lambda b: (-block_payload_size(b), b.block_id)):
        load, rank = heapq.heappop(loads)
        owners[block.block_id] = rank
        heapq.heappush(loads, (load + block_payload_size(block), rank))
    return owners


class _Segment:
    """One rank's mapping: header, flags ready/done/consumed per block, then the data."""

    def __init__(self, path: Path, nblocks: int, numel: int, create: bool) -> None:
        words = _HEADER_WORDS + 3 * nblocks
        self.size = 8 * words + 4 * max(numel, 1)
        if create:
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, self.size)
        else:
            fd = os.open(path, os.O_RDWR)
            actual = os.fstat(fd).st_size
            if actual != self.size:
                os.close(fd)
                raise IntraNodeError(f"{path} has {actual} bytes, expected {self.size}: "
                                     f"do the local ranks build the same model?")
        self.map = mmap.mmap(fd, self.size)
        os.close(fd)
        head = np.frombuffer(self.map, dtype=np.int64, count=words)
        self.header = head[:_HEADER_WORDS]
        self.ready, self.done, self.consumed = (head[_HEADER_WORDS + i * nblocks: _HEADER_WORDS + (i + 1) * nblocks]
                                                for i in range(3))
        self.data = torch.frombuffer(self.map, dtype=torch.float32, offset=8 * words, count=max(numel, 1))
        if create:
            self.header[1] = os.getpid()
            self.header[0] = _MAGIC
            os.rename(tmp, path)  # appears complete or not at all


class NodeReducer:
    def __init__(self, layout: ps_pb2.Layout, local_rank: int, local_world_size: int, node_rank: int,
                 job_id: str, timeout_s: float = 60.0) -> None:
        self.local_rank, self.size, self.timeout_s = local_rank, local_world_size, timeout_s
        self.owners = assign_owners(layout, local_world_size)
        self.offsets = np.cumsum([0] + [b.numel for b in layout.blocks]).tolist()
        numel, nblocks = self.offsets[-1], len(layout.blocks)
        tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in (job_id or "default"))[:64]
        paths = [SHM_DIR / f"cgxps-{tag}-n{node_rank}-r{r}" for r in range(local_world_size)]
        self._own_path = paths[local_rank]
        self._own_path.unlink(missing_ok=True)  # a leftover of a crashed earlier run
        self.segments: list[_Segment | None] = [None] * local_world_size
        self.segments[local_rank] = _Segment(paths[local_rank], nblocks, numel, create=True)
        try:
            self._attach(paths, nblocks, numel)
        finally:
            self._own_path.unlink(missing_ok=True)

    def _attach(self, paths: list[Path], nblocks: int, numel: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        for r, path in enumerate(paths):
            while self.segments[r] is None:
                if path.exists():
                    self.segments[r] = _Segment(path, nblocks, numel, create=False)
                elif time.monotonic() > deadline:
                    raise IntraNodeError(f"local rank {r} did not start within {self.timeout_s:g}s ({path})")
                else:
                    time.sleep(0.01)
        self.own.header[2] = 1  # attached to every peer: they may unlink their files now
        self._wait(lambda: all(s.header[2] for s in self.segments), "attach")  # type: ignore[union-attr]

    @property
    def own(self) -> _Segment:
        return self.segments[self.local_rank]  # type: ignore[return-value]

    def buffer(self, block_id: int) -> torch.Tensor:
        """This rank's float32 buffer of a block (a view into its segment)."""
        return self.own.data[self.offsets[block_id]: self.offsets[block_id + 1]]

    def owner(self, block_id: int) -> int:
        return self.owners[block_id]

    # ---- one block of one step (seq = step number + 1) ------------------------------------------

    def before_write(self, block_id: int, seq: int) -> None:
        """Owner only: peers must have copied the previous result out of our buffer."""
        if self.owner(block_id) == self.local_rank:
            self._wait(lambda: all(s.consumed[block_id] >= seq - 1 for r, s in enumerate(self.segments)
                                   if r != self.local_rank), f"block {block_id}: previous result not taken")

    def mark_ready(self, block_id: int, seq: int) -> None:
        self.own.ready[block_id] = seq

    async def reduce(self, block_id: int, seq: int, run_in_thread) -> None:
        """Owner: wait for every local rank's gradient of the block and sum them into ours."""
        await self.wait(lambda: all(s.ready[block_id] >= seq for s in self.segments), f"block {block_id}: gradient")
        mine = self.buffer(block_id)
        a, b = self.offsets[block_id], self.offsets[block_id + 1]
        peers = [seg.data[a:b] for r, seg in enumerate(self.segments) if r != self.local_rank]

        def add() -> None:
            for peer in peers:
                mine.add_(peer)

        await run_in_thread(add)

    def publish(self, block_id: int, seq: int) -> None:
        """Owner: the decoded result is in our buffer."""
        self.own.done[block_id] = seq

    async def fetch(self, block_id: int, seq: int, failed=lambda: None) -> None:
        """Non-owner: wait for the owner's result and copy it into our buffer. ``failed()``
        returns an error to raise instead of waiting on (the round failed on the shards)."""
        owner = self.owner(block_id)
        seg = self.segments[owner]
        await self.wait(lambda: seg.done[block_id] >= seq, f"block {block_id}: result from its owner", only=owner,
                        failed=failed)
        a, b = self.offsets[block_id], self.offsets[block_id + 1]
        self.buffer(block_id).copy_(seg.data[a:b])
        self.own.consumed[block_id] = seq

    async def wait(self, condition, what: str, only: int | None = None, failed=lambda: None) -> None:
        """Poll shared flags without holding a thread: waits on peers must never block the
        codec threads, or two ranks each waiting for the other's encode would deadlock."""
        deadline = time.monotonic() + self.timeout_s
        delay = 50e-6
        while not condition():
            error = failed()
            if error is not None:
                raise error
            self._check(what, deadline, only)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _wait(self, condition, what: str, only: int | None = None) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = 20e-6
        while not condition():
            self._check(what, deadline, only)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _check(self, what: str, deadline: float, only: int | None) -> None:
        for r, seg in enumerate(self.segments):
            if seg is not None and r != self.local_rank and (only is None or r == only) \
                    and not _alive(int(seg.header[1])):
                raise IntraNodeError(f"local rank {r} (pid {int(seg.header[1])}) exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise IntraNodeError(f"timed out after {self.timeout_s:g}s waiting for {what} (a local rank stalled?)")

    def close(self) -> None:
        """Remove our segment's name if it is still there (normally gone right after attach).
        The mappings themselves live as long as the block buffers that view them."""
        self._own_path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Is the process running? A zombie (exited, not yet reaped by its parent) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
