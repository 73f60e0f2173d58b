"""Intra-node reduction: the local ranks of a node sum their gradients first, so the node pushes
each block exactly once over its one NIC.

Blocks are split among the local ranks (balanced by wire bytes). For each block, its owner waits
until every local rank has written its gradient, sums them, and is the only one of the node to
compress and push it (a reduce-scatter). After the pull the owner publishes the decoded result
and the others copy it (an all-gather). So every block leaves the node exactly once and the
compression work is spread over the node's ranks.

Each rank's block buffers and flags live in its segment (``segment.py``), which the node's ranks
exchange once at start-up (``rendezvous.py``). Flags are stored with release and loaded with
acquire semantics (``shm_flags.py``), so a process that sees a flag also sees the data it
announces, on aarch64 as on x86-64.

When a shard fails an owner (stopped, cut off, a failed round), the node's other ranks must
report the shard, not the owner: they only see that its result does not come. So the owner
posts the error in its segment (``first_error``) and every wait on the node's flags raises a
peer's posted error first (``relayed_error``); and a rank waits for its owner's result longer
than the owner takes to give up on a silent shard (``result_timeout_s``), so a live owner has
posted before anyone blames it. The first error in the node is then the one every rank reports.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
import weakref
from typing import Awaitable, Callable

import numpy as np
import torch

from ... import timeline
from ...model_layout import block_payload_size
from ...v1 import ps_pb2
from ..config import WorkerConfig
from .. import errors
from ..errors import CgxPsError, ConfigError, IntraNodeError
from ..gpu_setup import decide_transport, peer_access_table
from ..pipeline.blocks import largest_first
from ..shards.recovery import HUNG_GRACE_S, LIVENESS_TIMEOUT_S
from .rendezvous import close_fds, exchange_fds, rendezvous_name
from .segment import Segment
from .shm_flags import load_acquire, store_release

__all__ = ["NodeReducer", "IntraNodeError", "OWNER_GIVES_UP_S", "assign_owners", "choose_transport", "close_all",
           "node_reducer", "relayed_error", "rendezvous_name"]

log = logging.getLogger(__name__)
# Beyond the round timeout, how long an owner may take to give up on a shard that answers nothing
# (recovery.py: HUNG_GRACE_S + LIVENESS_TIMEOUT_S + a supervisor tick), with room for the owner's
# own backward before it pushed: a rank waiting for its owner's result waits this much longer.
OWNER_GIVES_UP_S = HUNG_GRACE_S + LIVENESS_TIMEOUT_S + 10.0
_open_reducers: "weakref.WeakSet[NodeReducer]" = weakref.WeakSet()


def close_all() -> None:
    """Close every reducer of this process (``cgx_ps.worker.shutdown`` calls this)."""
    for reducer in list(_open_reducers):
        reducer.close()


RunInThread = Callable[[Callable[[], None]], Awaitable[None]]


def assign_owners(layout: ps_pb2.Layout, local_world_size: int) -> list[int]:
    """Owner local rank of every block, balanced by wire bytes (as blocks are over shards)."""
    return largest_first([block_payload_size(b) for b in layout.blocks], local_world_size)


def node_reducer(layout: ps_pb2.Layout, config: WorkerConfig, devices: set[torch.device], timeout_s: float,
                 run_tag: str = "") -> NodeReducer | None:
    """With several ranks on this node they reduce among themselves first: over CUDA IPC for a
    model on one GPU (unless CGX_PS_INTRANODE=shm), else over host shared memory."""
    if config.local_world_size == 1:
        return None
    device, transport = next(iter(devices)), config.intranode
    if len(devices) > 1:
        if transport == "cuda":
            raise ConfigError(f"CGX_PS_INTRANODE=cuda needs the model on one GPU, it spans {sorted(map(str, devices))}")
        device, transport = torch.device("cpu"), "shm"
    return NodeReducer(layout, config.local_rank, config.local_world_size, config.node_rank,
                       config.job_id or os.environ.get("TORCHELASTIC_RUN_ID", ""), timeout_s=timeout_s, device=device,
                       transport=transport, run_tag=run_tag)


def choose_transport(requested: str, device: torch.device) -> str:
    """``auto`` picks CUDA IPC for a model on a GPU when CuPy is there for the IPC calls and the
    visible GPUs can map each other's memory (``gpu_setup.decide_transport``), and host shared
    memory otherwise, saying why in one log line."""
    wants_gpu = requested in ("auto", "cuda") and device.type == "cuda"
    access = peer_access_table(torch.cuda.device_count()) if wants_gpu else {}
    cupy_ok = _cupy_importable() if wants_gpu and requested == "auto" else False
    choice = decide_transport(requested, device, cupy_ok, access)
    if choice.warning:
        log.warning("%s", choice.warning)
    return choice.transport


class NodeReducer:
    """One local rank's side of the node's reduce-scatter + all-gather (see the module doc).

    Per block and step (``seq`` = step + 1), in order: ``before_write`` (owner), write the
    gradient into ``buffer(b)``, ``mark_ready``; then the owner ``reduce``s, exchanges with the
    shards, writes the result into ``buffer(b)`` and ``publish``es, while the others ``fetch``.

    ``run_tag`` is a random string of this run, the same on every local rank of the node (the
    shards' session id): it makes the rendezvous name unpredictable. Empty still works, with a
    name other users can guess and squat (they are detected and named, but block the start).
    """

    def __init__(self, layout: ps_pb2.Layout, local_rank: int, local_world_size: int, node_rank: int,
                 job_id: str, timeout_s: float = 60.0, device: torch.device | str = "cpu",
                 transport: str = "auto", run_tag: str = "") -> None:
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
        self._votes = 0  # votes taken so far (``vote``): the same count on every local rank
        self.segments: list[Segment | None] = [None] * local_world_size
        own, own_fd = Segment.create(nblocks, self.transport, export, numel if self.transport == "shm" else 0,
                                      name=f"cgxps-n{node_rank}-r{local_rank}")
        self.segments[local_rank] = own
        try:
            peer_fds = exchange_fds(rendezvous_name(job_id or "default", run_tag, node_rank), own_fd,
                                     local_rank, local_world_size, timeout_s)
        finally:
            os.close(own_fd)  # our mapping keeps the segment; the peers hold their own descriptors
        try:
            self._attach(peer_fds, nblocks, numel)
        finally:
            close_fds(peer_fds.values())
        self._data = self._gpu.data if self._gpu is not None else self.own.data
        # every peer's buffer as this process sees it: a view of its segment, or its GPU memory
        self._peers = {}
        for r, seg in enumerate(self.segments):
            if r != self.local_rank:
                self._peers[r] = self._open_peer(seg, nblocks)  # type: ignore[arg-type]
        _open_reducers.add(self)

    def _attach(self, peer_fds: dict[int, int], nblocks: int, numel: int) -> None:
        """Map every peer's segment and check it before anything in it is used."""
        for r, fd in sorted(peer_fds.items()):
            seg = Segment.open(fd, f"local rank {r}")
            self._check_peer(r, seg, nblocks, numel)
            self.segments[r] = seg
        self.own.header[2] = 1  # mapped every peer (for debugging: nothing waits on it)

    def _check_peer(self, r: int, seg: Segment, nblocks: int, numel: int) -> None:
        if seg.transport != self.transport:
            raise IntraNodeError(f"local rank {r} reduces over {seg.transport} but this rank over {self.transport}: "
                                 f"put every local rank's model on the same kind of device, or set "
                                 f"CGX_PS_INTRANODE the same on all")
        if seg.nblocks != nblocks or seg.host_numel != (numel if self.transport == "shm" else 0):
            raise IntraNodeError(f"local rank {r} has {seg.nblocks} blocks / {seg.host_numel} floats, this rank "
                                 f"{nblocks} / {numel}: do the local ranks build the same model?")

    def _open_peer(self, seg: Segment, nblocks: int):
        if self._gpu is None:
            return seg.data
        from .cuda_ipc import CudaIpcBuffer

        return CudaIpcBuffer.open(seg.export, nblocks, self._gpu.device)

    @property
    def own(self) -> Segment:
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

    @property
    def result_timeout_s(self) -> float:
        """How long a rank waits for its owner's result: past the owner's own shard timeout."""
        return self.timeout_s + OWNER_GIVES_UP_S

    def first_error(self, error: CgxPsError) -> CgxPsError:
        """Our exchange with the shards ended with ``error``: the error to raise, a peer's posted
        one if there is one already (the node's first), else ours, posted for the peers to raise."""
        posted = self._posted_by_peer()
        if posted is not None:
            return posted
        self.own.post_error(type(error).__name__, str(error))
        return error

    def _posted_by_peer(self) -> CgxPsError | None:
        for r, seg in enumerate(self.segments):
            posted = seg.posted_error() if seg is not None and r != self.local_rank else None
            if posted is not None:
                return relayed_error(r, *posted)
        return None

    def vote(self, value: int, what: str) -> list[int]:
        """Every local rank's ``value`` for a decision the node's ranks must take alike (quorum
        rounds: whether the node was late, pipeline/catch_up.py), by local rank. Every rank calls
        it at the same point of its steps; a rank waits for the others as for its owner's result."""
        self._votes += 1
        tag = self._votes
        self.own.post_vote(tag, value)
        self._wait(lambda: all(s.vote(tag) is not None for s in self.segments), what,
                   behind=lambda: [r for r, s in enumerate(self.segments) if s.vote(tag) is None],
                   timeout_s=self.result_timeout_s)
        return [s.vote(tag) for s in self.segments]  # type: ignore[misc]

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

        await run_in_thread(timeline.wrapped(add, "local sum", seq - 1, block=block_id))

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
                        only=owner, failed=failed, behind=lambda: [owner], timeout_s=self.result_timeout_s)
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
                   behind=lambda: [], timeout_s: float | None = None) -> None:
        """Poll shared flags without holding a thread: waits on peers must never block the
        codec threads, or two ranks each waiting for the other's encode would deadlock.
        ``behind()`` lists the local ranks still holding the wait up (named on a timeout)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        delay = 50e-6
        while not condition():
            error = failed()
            if error is not None:
                raise error
            self._check(what, deadline, only, behind, timeout_s)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _wait(self, condition, what: str, only: int | None = None, behind=lambda: [],
              timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        delay = 20e-6
        while not condition():
            self._check(what, deadline, only, behind, timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _check(self, what: str, deadline: float, only: int | None, behind=lambda: [],
               timeout_s: float | None = None) -> None:
        posted = self._posted_by_peer()
        if posted is not None:
            raise posted
        for r, seg in enumerate(self.segments):
            if seg is not None and r != self.local_rank and (only is None or r == only) \
                    and not _alive(seg.pid):
                raise IntraNodeError(f"local rank {r} (pid {seg.pid}) exited while waiting for {what}")
        if time.monotonic() > deadline:
            late = behind()
            who = f"local rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} stalled?" if late \
                else "a local rank stalled?"
            raise IntraNodeError(f"timed out after {timeout_s or self.timeout_s:g}s waiting for {what} ({who})")

    def close(self) -> None:
        """GPU: unmap the peers' buffers, then wait (briefly) until the peers unmapped ours, since
        memory freed under an importer's open IPC mapping is undefined behaviour. Host mappings
        (and with them the memfds) live as long as the block buffers that view them; there is
        no name to remove."""
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


def relayed_error(local_rank: int, kind: str, message: str) -> CgxPsError:
    """A peer's posted error, raised here as the same kind where its class takes a message alone
    (ShardUnavailableError, IntraNodeError, ...), so training code catches it by kind on every
    rank; an IntraNodeError carrying its kind and words otherwise."""
    text = f"{message} (reported by local rank {local_rank})"
    cls = getattr(errors, kind, None) if kind in errors.__all__ else None
    if isinstance(cls, type) and issubclass(cls, CgxPsError):
        try:
            return cls(text)
        except TypeError:  # ShardRejectedError, RoundFailedError: other fields
            pass
    return IntraNodeError(f"local rank {local_rank} failed: {kind}: {message}")


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
