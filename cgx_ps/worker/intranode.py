"""Intra-node reduction: the local ranks of a node sum their gradients first, so the node pushes
each block exactly once over its one NIC.

Blocks are split among the local ranks (balanced by wire bytes). For each block, its owner waits
until every local rank has written its gradient, sums them, and is the only one of the node to
compress and push it (a reduce-scatter). After the pull the owner publishes the decoded result
and the others copy it (an all-gather). So every block leaves the node exactly once and the
compression work is spread over the node's ranks.

Two data planes carry the block buffers, one control plane orders them:

* control (always): one POSIX shared-memory segment per local rank in ``/dev/shm`` with a
  header (magic, pid, transport, sizes) and three flags per block: ``ready`` (my gradient is in
  my buffer), ``done`` (owner: the result is in my buffer), ``consumed`` (I copied the owner's
  result). Flags hold the step number + 1, so they never need resetting.
* data, ``shm``: every block's float32 buffer lives in the same segment; peers read it directly.
* data, ``cuda``: buffers stay on the GPUs; the segment carries the CUDA IPC memory handle, its
  offset from the allocation base and one IPC event handle per block (see ``cuda_ipc.py``).
  A flag is raised only after the event that orders the GPU writes it announces was recorded.

Segments are unlinked as soon as every rank has mapped them, so nothing is left in /dev/shm
even if a process is killed later. A local rank that dies or stalls makes the others fail
within the timeout with an error that names it.

Flags are stored with release and loaded with acquire semantics (``shm_flags.py``), so a
process that sees a flag also sees the data it announces, on aarch64 as on x86-64.
"""

from __future__ import annotations

import asyncio
import heapq
import importlib
import logging
import mmap
import os
import time
import weakref
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
import torch

from ..layout import block_payload_size
from ..v1 import ps_pb2
from .errors import ConfigError, IntraNodeError
from .shm_flags import load_acquire, store_release

__all__ = ["NodeReducer", "IntraNodeError", "assign_owners", "choose_transport", "close_all", "SHM_DIR"]

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
_MAGIC = 0x43475850534E4F44  # "CGXPSNOD"
# header words: magic, pid, attached, transport, blocks, export bytes, host floats, detached
_HEADER_WORDS = 8
_open_reducers: "weakref.WeakSet[NodeReducer]" = weakref.WeakSet()


def close_all() -> None:
    """Close every reducer of this process (``cgx_ps.worker.shutdown`` calls this)."""
    for reducer in list(_open_reducers):
        reducer.close()
_TRANSPORT_CODE = {"shm": 1, "cuda": 2}
_TRANSPORT_NAME = {v: k for k, v in _TRANSPORT_CODE.items()}

RunInThread = Callable[[Callable[[], None]], Awaitable[None]]


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


def choose_transport(requested: str, device: torch.device) -> str:
    """``auto`` picks CUDA IPC for a model on a GPU (when CuPy is there for the IPC calls) and
    host shared memory otherwise."""
    if requested == "auto":
        if device.type != "cuda":
            return "shm"
        if _cupy_importable():
            return "cuda"
        log.warning("CUDA IPC needs CuPy (pip install 'cgx-ps[cuda12]'); local ranks reduce through host "
                    "shared memory instead")
        return "shm"
    if requested == "cuda" and device.type != "cuda":
        raise ConfigError(f"CGX_PS_INTRANODE=cuda needs the model on a GPU, but its parameters are on {device}")
    if requested not in _TRANSPORT_CODE:
        raise ConfigError(f"CGX_PS_INTRANODE={requested!r} is not one of auto, shm, cuda")
    return requested


class _Segment:
    """One rank's control segment: header, flags ready/done/consumed per block, the exported
    CUDA IPC record (cuda) and the block data (shm)."""

    def __init__(self, path: Path, *, create: bool, nblocks: int = 0, transport: str = "shm",
                 export: bytes = b"", host_numel: int = 0) -> None:
        if create:
            size = self._size(nblocks, len(export), host_numel)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
            if size < 8 * _HEADER_WORDS:
                os.close(fd)
                raise IntraNodeError(f"{path} is truncated ({size} bytes)")
        self.map = mmap.mmap(fd, size)
        os.close(fd)
        self.header = np.frombuffer(self.map, dtype=np.int64, count=_HEADER_WORDS)
        if create:
            self.header[1:7] = [os.getpid(), 0, _TRANSPORT_CODE[transport], nblocks, len(export), host_numel]
        elif self.header[0] != _MAGIC or size != self._size(*(int(x) for x in self.header[4:7])):
            raise IntraNodeError(f"{path} is not a cgx-ps segment of this version")
        nblocks, export_len, host_numel = (int(x) for x in self.header[4:7])
        flags = np.frombuffer(self.map, dtype=np.int64, count=3 * nblocks, offset=8 * _HEADER_WORDS)
        self.ready, self.done, self.consumed = flags[:nblocks], flags[nblocks:2 * nblocks], flags[2 * nblocks:]
        at = 8 * (_HEADER_WORDS + 3 * nblocks)
        if create:
            self.map[at:at + export_len] = export
        self.export = bytes(self.map[at:at + export_len])
        at += -(-export_len // 8) * 8
        self.data = torch.frombuffer(self.map, dtype=torch.float32, offset=at, count=host_numel) \
            if host_numel else torch.zeros(0)
        if create:
            self.header[0] = _MAGIC
            os.rename(tmp, path)  # appears complete or not at all

    @staticmethod
    def _size(nblocks: int, export_len: int, host_numel: int) -> int:
        return 8 * (_HEADER_WORDS + 3 * nblocks) + -(-export_len // 8) * 8 + 4 * host_numel

    @property
    def pid(self) -> int:
        return int(self.header[1])

    @property
    def transport(self) -> str:
        return _TRANSPORT_NAME.get(int(self.header[3]), f"unknown({int(self.header[3])})")

    @property
    def nblocks(self) -> int:
        return int(self.header[4])

    @property
    def host_numel(self) -> int:
        return int(self.header[6])


class NodeReducer:
    """One local rank's side of the node's reduce-scatter + all-gather (see the module doc).

    Per block and step (``seq`` = step + 1), in order: ``before_write`` (owner), write the
    gradient into ``buffer(b)``, ``mark_ready``; then the owner ``reduce``s, exchanges with the
    shards, writes the result into ``buffer(b)`` and ``publish``es, while the others ``fetch``.
    """

    def __init__(self, layout: ps_pb2.Layout, local_rank: int, local_world_size: int, node_rank: int,
                 job_id: str, timeout_s: float = 60.0, device: torch.device | str = "cpu",
                 transport: str = "auto") -> None:
        self.local_rank, self.size, self.timeout_s = local_rank, local_world_size, timeout_s
        self.owners = assign_owners(layout, local_world_size)
        self.offsets = np.cumsum([0] + [b.numel for b in layout.blocks]).tolist()
        numel, nblocks = self.offsets[-1], len(layout.blocks)
        self.transport = choose_transport(transport, torch.device(device))
        self._gpu = None
        export = b""
        if self.transport == "cuda":
            from .cuda_ipc import CudaIpcBuffer

            self._gpu = CudaIpcBuffer(numel, nblocks, torch.device(device))
            export = self._gpu.export()
        tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in (job_id or "default"))[:64]
        paths = [SHM_DIR / f"cgxps-{tag}-n{node_rank}-r{r}" for r in range(local_world_size)]
        self._own_path = paths[local_rank]
        self._own_path.unlink(missing_ok=True)  # a leftover of a crashed earlier run
        self.segments: list[_Segment | None] = [None] * local_world_size
        self.segments[local_rank] = _Segment(paths[local_rank], create=True, nblocks=nblocks,
                                             transport=self.transport, export=export,
                                             host_numel=numel if self.transport == "shm" else 0)
        try:
            self._attach(paths, nblocks, numel)
        finally:
            self._own_path.unlink(missing_ok=True)
        self._data = self._gpu.data if self._gpu is not None else self.own.data
        # every peer's buffer as this process sees it: a view of its segment, or its GPU memory
        self._peers = {}
        for r, seg in enumerate(self.segments):
            if r != self.local_rank:
                self._peers[r] = self._open_peer(seg, nblocks)  # type: ignore[arg-type]
        _open_reducers.add(self)

    def _attach(self, paths: list[Path], nblocks: int, numel: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        for r, path in enumerate(paths):
            while self.segments[r] is None:
                if path.exists():
                    seg = _Segment(path, create=False)
                    self._check_peer(r, seg, nblocks, numel)
                    self.segments[r] = seg
                elif time.monotonic() > deadline:
                    raise IntraNodeError(f"local rank {r} did not start within {self.timeout_s:g}s ({path})")
                else:
                    time.sleep(0.01)
        self.own.header[2] = 1  # attached to every peer: they may unlink their files now
        self._wait(lambda: all(s.header[2] for s in self.segments), "attach")  # type: ignore[union-attr]

    def _check_peer(self, r: int, seg: _Segment, nblocks: int, numel: int) -> None:
        if seg.transport != self.transport:
            raise IntraNodeError(f"local rank {r} reduces over {seg.transport} but this rank over {self.transport}: "
                                 f"put every local rank's model on the same kind of device, or set "
                                 f"CGX_PS_INTRANODE the same on all")
        if seg.nblocks != nblocks or seg.host_numel != (numel if self.transport == "shm" else 0):
            raise IntraNodeError(f"local rank {r} has {seg.nblocks} blocks / {seg.host_numel} floats, this rank "
                                 f"{nblocks} / {numel}: do the local ranks build the same model?")

    def _open_peer(self, seg: _Segment, nblocks: int):
        if self._gpu is None:
            return seg.data
        from .cuda_ipc import CudaIpcBuffer

        return CudaIpcBuffer.open(seg.export, nblocks, self._gpu.device)

    @property
    def own(self) -> _Segment:
        return self.segments[self.local_rank]  # type: ignore[return-value]

    def buffer(self, block_id: int) -> torch.Tensor:
        """This rank's float32 buffer of a block (a view into its segment or its GPU buffer)."""
        return self._data[self.offsets[block_id]: self.offsets[block_id + 1]]

    def _peer_block(self, r: int, block_id: int) -> torch.Tensor:
        peer = self._peers[r]
        data = peer if self._gpu is None else peer.data
        return data[self.offsets[block_id]: self.offsets[block_id + 1]]

    def owner(self, block_id: int) -> int:
        return self.owners[block_id]

    # ---- one block of one step (seq = step number + 1) ------------------------------------------

    def before_write(self, block_id: int, seq: int) -> None:
        """Owner only: peers must have copied the previous result out of our buffer."""
        if self.owner(block_id) == self.local_rank:
            self._wait(lambda: all(load_acquire(s.consumed, block_id) >= seq - 1 for r, s in enumerate(self.segments)
                                   if r != self.local_rank), f"block {block_id}: previous result not taken",
                       behind=lambda: [r for r, s in enumerate(self.segments)
                                       if r != self.local_rank and load_acquire(s.consumed, block_id) < seq - 1])

    def mark_ready(self, block_id: int, seq: int) -> None:
        """Our gradient of the block is written (on the current stream, for a GPU buffer)."""
        if self._gpu is not None:
            self._gpu.written(block_id)  # the event peers wait on is recorded before the flag
        store_release(self.own.ready, block_id, seq)

    async def reduce(self, block_id: int, seq: int, run_in_thread: RunInThread) -> None:
        """Owner: wait for every local rank's gradient of the block and sum them into ours."""
        await self.wait(lambda: all(load_acquire(s.ready, block_id) >= seq for s in self.segments),
                        f"block {block_id}: gradient",
                        behind=lambda: [r for r, s in enumerate(self.segments) if load_acquire(s.ready, block_id) < seq])
        mine = self.buffer(block_id)
        peers = [r for r in range(self.size) if r != self.local_rank]

        def add() -> None:
            for r in peers:  # a fixed order (ours, then the others by rank): the same bits on any device
                if self._gpu is not None:
                    self._peers[r].wait(block_id)  # on our stream; the peer's memory is mapped on our GPU
                mine.add_(self._peer_block(r, block_id))
            if self._gpu is not None:
                torch.cuda.current_stream(mine.device).synchronize()

        await run_in_thread(add)

    def publish(self, block_id: int, seq: int) -> None:
        """Owner: the decoded result is in our buffer."""
        if self._gpu is not None:
            self._gpu.written(block_id)
        store_release(self.own.done, block_id, seq)

    async def fetch(self, block_id: int, seq: int, failed=lambda: None,
                    run_in_thread: RunInThread | None = None) -> None:
        """Non-owner: wait for the owner's result and copy it into our buffer. ``failed()``
        returns an error to raise instead of waiting on (the round failed on the shards)."""
        owner = self.owner(block_id)
        seg = self.segments[owner]
        await self.wait(lambda: load_acquire(seg.done, block_id) >= seq, f"block {block_id}: result from its owner",
                        only=owner, failed=failed, behind=lambda: [owner])
        mine, theirs = self.buffer(block_id), self._peer_block(owner, block_id)

        def copy() -> None:
            if self._gpu is not None:
                self._peers[owner].wait(block_id)
            mine.copy_(theirs, non_blocking=True)
            if self._gpu is not None:  # the owner may overwrite its buffer once we say consumed
                torch.cuda.current_stream(mine.device).synchronize()

        if run_in_thread is not None and self._gpu is not None:
            await run_in_thread(copy)
        else:
            copy()
        store_release(self.own.consumed, block_id, seq)

    async def wait(self, condition, what: str, only: int | None = None, failed=lambda: None,
                   behind=lambda: []) -> None:
        """Poll shared flags without holding a thread: waits on peers must never block the
        codec threads, or two ranks each waiting for the other's encode would deadlock.
        ``behind()`` lists the local ranks still holding the wait up (named on a timeout)."""
        deadline = time.monotonic() + self.timeout_s
        delay = 50e-6
        while not condition():
            error = failed()
            if error is not None:
                raise error
            self._check(what, deadline, only, behind)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _wait(self, condition, what: str, only: int | None = None, behind=lambda: []) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = 20e-6
        while not condition():
            self._check(what, deadline, only, behind)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _check(self, what: str, deadline: float, only: int | None, behind=lambda: []) -> None:
        for r, seg in enumerate(self.segments):
            if seg is not None and r != self.local_rank and (only is None or r == only) \
                    and not _alive(seg.pid):
                raise IntraNodeError(f"local rank {r} (pid {seg.pid}) exited while waiting for {what}")
        if time.monotonic() > deadline:
            late = behind()
            who = f"local rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} stalled?" if late \
                else "a local rank stalled?"
            raise IntraNodeError(f"timed out after {self.timeout_s:g}s waiting for {what} ({who})")

    def close(self) -> None:
        """Remove our segment's name if it is still there (normally gone right after attach).
        GPU: unmap the peers' buffers, then wait (briefly) until the peers unmapped ours, since
        memory freed under an importer's open IPC mapping is undefined behaviour. Host mappings
        live as long as the block buffers that view them."""
        self._own_path.unlink(missing_ok=True)
        _open_reducers.discard(self)
        if self._gpu is None or not self._peers:
            return
        try:
            for r, peer in self._peers.items():
                try:
                    peer.close()
                except Exception as e:  # still tell the peers we are done with their memory
                    log.warning("unmapping local rank %d's GPU buffer failed: %s", r, e)
        finally:
            self._peers.clear()
            self.own.header[7] = 1
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        while time.monotonic() < deadline and not all(
                s.header[7] or not _alive(s.pid) for r, s in enumerate(self.segments) if r != self.local_rank):
            time.sleep(0.005)


def _cupy_importable() -> bool:
    try:
        importlib.import_module("cupy")
    except Exception:  # absent, or cannot load its CUDA libraries
        return False
    return True


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
