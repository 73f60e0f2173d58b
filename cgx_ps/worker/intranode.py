"""Intra-node reduction: the local ranks of a node sum their gradients first, so the node pushes
each block exactly once over its one NIC.

Blocks are split among the local ranks (balanced by wire bytes). For each block, its owner waits
until every local rank has written its gradient, sums them, and is the only one of the node to
compress and push it (a reduce-scatter). After the pull the owner publishes the decoded result
and the others copy it (an all-gather). So every block leaves the node exactly once and the
compression work is spread over the node's ranks.

Two data planes carry the block buffers, one control plane orders them:

* control (always): one shared-memory segment per local rank, an anonymous sealed ``memfd``
  (no file name anywhere), with a header (magic, pid, transport, sizes) and three flags per
  block: ``ready`` (my gradient is in my buffer), ``done`` (owner: the result is in my buffer),
  ``consumed`` (I copied the owner's result). Flags hold the step number + 1, so they never
  need resetting.
* data, ``shm``: every block's float32 buffer lives in the same segment; peers read it directly.
* data, ``cuda``: buffers stay on the GPUs; the segment carries the CUDA IPC memory handle, its
  offset from the allocation base and one IPC event handle per block (see ``cuda_ipc.py``).
  A flag is raised only after the event that orders the GPU writes it announces was recorded.

Rendezvous: the segments' file descriptors are exchanged once, at start-up, over a Unix socket
in the Linux abstract namespace (``rendezvous_name``: uid, a hash of job id and the run's
random tag, node rank). Local rank 0 listens; every other rank connects and sends its memfd;
rank 0 then sends every rank all of them (SCM_RIGHTS), and the sockets are closed. Both ends
check the other's uid with SO_PEERCRED, so another local user can neither plant a segment nor
obtain ours; the peers' headers are checked before anything is summed. Abstract sockets and
memfds have no file, so nothing is left behind whatever rank is killed, and when: the kernel
frees them with their last process. A local rank that dies or stalls makes the others fail
within the timeout with an error that names it.

Flags are stored with release and loaded with acquire semantics (``shm_flags.py``), so a
process that sees a flag also sees the data it announces, on aarch64 as on x86-64.
"""

from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import hashlib
import importlib
import logging
import mmap
import os
import socket
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection

import numpy as np
import torch

from ..layout import block_payload_size
from ..v1 import ps_pb2
from .config import WorkerConfig
from .errors import ConfigError, IntraNodeError
from .layout import largest_first
from .shm_flags import load_acquire, store_release

__all__ = ["NodeReducer", "IntraNodeError", "assign_owners", "choose_transport", "close_all", "node_reducer",
           "rendezvous_name"]

log = logging.getLogger(__name__)
_MAGIC = 0x43475850534E4F44  # "CGXPSNOD"
# header words: magic, pid, mapped (diagnostic), transport, blocks, export bytes, host floats, detached
_HEADER_WORDS = 8
# a peer must not be able to shrink its segment under our mapping (reads past the end are SIGBUS)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_RDV_MAGIC = b"CGXPSRDV"
_HELLO = struct.Struct("<8sII")  # member -> local rank 0: magic, local rank, local world size (+ its memfd)
_REPLY = struct.Struct("<8sI")  # local rank 0 -> member: magic, local world size (+ every rank's memfd)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SCM_MAX_FD = 253  # the kernel's limit of descriptors in one SCM_RIGHTS message
_open_reducers: "weakref.WeakSet[NodeReducer]" = weakref.WeakSet()


def close_all() -> None:
    """Close every reducer of this process (``cgx_ps.worker.shutdown`` calls this)."""
    for reducer in list(_open_reducers):
        reducer.close()
_TRANSPORT_CODE = {"shm": 1, "cuda": 2}
_TRANSPORT_NAME = {v: k for k, v in _TRANSPORT_CODE.items()}

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
    CUDA IPC record (cuda) and the block data (shm). ``create`` makes ours, ``open`` maps a
    peer's from the descriptor it sent; either way the descriptor can be closed afterwards.
    (Python's ``mmap`` keeps its own close-on-exec duplicate of it until the mapping is freed.)"""

    def __init__(self, mapping: mmap.mmap, who: str) -> None:
        self.map = mapping
        self.header = np.frombuffer(mapping, dtype=np.int64, count=_HEADER_WORDS)
        sizes = [int(x) for x in self.header[4:7]]  # blocks, export bytes, host floats
        if self.header[0] != _MAGIC or min(sizes) < 0 or len(mapping) != self._size(*sizes):
            raise IntraNodeError(f"{who} sent a segment that is not a cgx-ps segment of this version")
        nblocks, export_len, host_numel = (int(x) for x in self.header[4:7])
        flags = np.frombuffer(mapping, dtype=np.int64, count=3 * nblocks, offset=8 * _HEADER_WORDS)
        self.ready, self.done, self.consumed = flags[:nblocks], flags[nblocks:2 * nblocks], flags[2 * nblocks:]
        at = self._export_at(nblocks)
        self.export = bytes(mapping[at:at + export_len])
        at += -(-export_len // 8) * 8
        self.data = torch.frombuffer(mapping, dtype=torch.float32, offset=at, count=host_numel) \
            if host_numel else torch.zeros(0)

    @classmethod
    def create(cls, nblocks: int, transport: str = "shm", export: bytes = b"", host_numel: int = 0,
               name: str = "cgxps-segment") -> tuple["_Segment", int]:
        """A new segment of this process and its memfd (to send to the peers, then close)."""
        size = cls._size(nblocks, len(export), host_numel)
        fd = _sealed_memfd(name, size)
        try:
            mapping = mmap.mmap(fd, size)
            at = cls._export_at(nblocks)
            mapping[at:at + len(export)] = export
            # complete before anyone can see it: it leaves this process only after this
            np.frombuffer(mapping, dtype=np.int64, count=_HEADER_WORDS)[:] = [
                _MAGIC, os.getpid(), 0, _TRANSPORT_CODE[transport], nblocks, len(export), host_numel, 0]
            return cls(mapping, "this rank"), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, fd: int, who: str) -> "_Segment":
        """Map a peer's segment from the descriptor it sent (the caller still owns ``fd``)."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # EINVAL: not a memfd (a regular file, a pipe, a socket, ...)
            raise IntraNodeError(f"{who} sent a descriptor that is not a memfd, not a cgx-ps segment") from None
        if _SEALS & ~seals:
            raise IntraNodeError(f"{who} sent a memfd that is not sealed against resizing, not a cgx-ps segment")
        size = os.fstat(fd).st_size
        if size < 8 * _HEADER_WORDS:
            raise IntraNodeError(f"{who} sent a segment of {size} bytes, too small for a cgx-ps segment")
        return cls(mmap.mmap(fd, size), who)

    @staticmethod
    def _export_at(nblocks: int) -> int:
        return 8 * (_HEADER_WORDS + 3 * nblocks)

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


def _sealed_memfd(name: str, size: int) -> int:
    """An anonymous shared-memory file of ``size`` bytes, sealed at that size. It has no name
    in any directory: only processes we hand the descriptor to can map it, and it is freed
    when the last one closes or dies (kill -9 included)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- rendezvous: exchanging the memfds over an abstract Unix socket -----------------------------------


def rendezvous_name(job_id: str, run_tag: str, node_rank: int) -> bytes:
    """The abstract socket (leading NUL: no file, gone with its process) where local rank 0 of
    ``node_rank`` waits for the others. The uid keeps users apart; the run's random tag makes
    the name unpredictable before rank 0 binds it, so it cannot be squatted in advance, and
    keeps two runs of one job apart. Hashing bounds the length (108 bytes at most)."""
    digest = hashlib.sha256(f"{job_id}\0{run_tag}".encode()).hexdigest()[:16]
    return f"\0cgxps-{os.getuid()}-{digest}-n{node_rank}".encode()


def _printable(name: bytes) -> str:
    return "@" + name[1:].decode()  # how ss(8) and /proc/net/unix show abstract names


def _socket() -> socket.socket:
    # SEQPACKET keeps message boundaries (a message and its descriptors arrive whole) on a
    # connection, which SO_PEERCRED needs; Python creates it close-on-exec
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel recorded them at connect()
    or listen(): the other side cannot forge them."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _foreign_user(uid: int) -> bool:
    """Processes of our own uid are trusted (they could ptrace us anyway); no one else is."""
    return uid != os.getuid()


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 1e-3)


def _send(sock: socket.socket, data: bytes, fds: list[int], who: str) -> None:
    try:  # MSG_NOSIGNAL: a peer that died is an error here, never SIGPIPE for the process
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], socket.MSG_NOSIGNAL)
    except OSError as e:
        raise IntraNodeError(f"{who} closed the connection during start-up ({e.strerror}): killed, or failed "
                             f"(see its own error)") from None


def _receive(sock: socket.socket, deadline: float, maxfds: int, who: str, timeout_s: float) -> tuple[bytes, list[int]]:
    """One message and its descriptors. The caller owns the descriptors only if this returns."""
    sock.settimeout(_remaining(deadline))
    try:
        # MSG_CMSG_CLOEXEC: a fork+exec on another thread must not inherit the segments
        # (socket.recv_fds drops its flags argument before Python 3.12, hence recvmsg)
        data, ancdata, flags, _ = sock.recvmsg(64, socket.CMSG_SPACE(maxfds * 4), socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise IntraNodeError(f"timed out after {timeout_s:g}s waiting for {who} during start-up") from None
    except OSError as e:  # ECONNRESET: it died
        data, ancdata, flags = b"", [], 0
        log.debug("receiving from %s: %s", who, e)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    fds = list(fds)
    if not data or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        _close(fds)
        raise IntraNodeError(f"{who} closed the connection during start-up: killed, or failed (see its own error)"
                             if not data else f"{who} sent an oversized start-up message, not a cgx-ps local rank")
    return data, fds


def _close(fds: Collection[int]) -> None:
    for fd in fds:
        os.close(fd)


def _member_rank(data: bytes, nfds: int, size: int, arrived: Collection[int], who: str) -> int:
    """The local rank a member's hello announces, if it fits this node."""
    if len(data) != _HELLO.size or nfds != 1 or _HELLO.unpack(data)[0] != _RDV_MAGIC:
        raise IntraNodeError(f"{who} sent a malformed hello: not a cgx-ps local rank of this version")
    _, rank, their_size = _HELLO.unpack(data)
    if their_size != size:
        raise IntraNodeError(f"local rank {rank} ({who}) counts {their_size} local ranks, this rank {size}: "
                             f"is LOCAL_WORLD_SIZE the same on every local rank?")
    if not 0 < rank < size:
        raise IntraNodeError(f"{who} claims local rank {rank}, outside 1..{size - 1}")
    if rank in arrived:
        raise IntraNodeError(f"local rank {rank} connected twice (the second time {who}): do two runs share "
                             f"one job id and session on this node?")
    return rank


def _check_reply(data: bytes, nfds: int, size: int) -> None:
    if len(data) != _REPLY.size or _REPLY.unpack(data) != (_RDV_MAGIC, size) or nfds != size:
        raise IntraNodeError(f"local rank 0 sent a malformed reply ({nfds} descriptors for {size} local ranks): "
                             f"not a cgx-ps local rank of this version, or a different local world size")


def _not_started_message(missing: list[int], timeout_s: float, refused: list[tuple[int, int]]) -> str:
    s = "s" if len(missing) > 1 else ""
    message = f"local rank{s} {', '.join(map(str, missing))} did not start within {timeout_s:g}s"
    if refused:
        message += "; refused connections from other users: " + ", ".join(f"uid {u} (pid {p})" for p, u in refused)
    return message + (" (all local ranks must run as one user, in one network namespace, with the same job id "
                      "and session)")


@dataclass
class _Member:
    conn: socket.socket
    pid: int
    fd: int


def _exchange_fds(name: bytes, own_fd: int, local_rank: int, size: int, timeout_s: float) -> dict[int, int]:
    """Every other local rank's segment descriptor, by rank (the caller closes them)."""
    if size > _SCM_MAX_FD:
        raise IntraNodeError(f"intra-node reduction supports at most {_SCM_MAX_FD} local ranks, not {size}")
    if size == 1:
        return {}
    deadline = time.monotonic() + timeout_s
    if local_rank == 0:
        return _lead(name, own_fd, size, deadline, timeout_s)
    return _join(name, own_fd, local_rank, size, deadline, timeout_s)


def _lead(name: bytes, own_fd: int, size: int, deadline: float, timeout_s: float) -> dict[int, int]:
    """Local rank 0: take one memfd from each other local rank, then send each all of them."""
    with _socket() as server:
        _bind(server, name)
        server.listen(size)
        members: dict[int, _Member] = {}
        try:
            _gather(server, members, size, deadline, timeout_s)
            reply = _REPLY.pack(_RDV_MAGIC, size)
            fds = [own_fd] + [members[r].fd for r in range(1, size)]
            for r, m in sorted(members.items()):
                _send(m.conn, reply, fds, f"local rank {r} (pid {m.pid})")
            return {r: m.fd for r, m in members.items()}
        except BaseException:
            _close([m.fd for m in members.values()])
            raise
        finally:
            for m in members.values():
                m.conn.close()


def _bind(server: socket.socket, name: bytes) -> None:
    try:
        server.bind(name)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise IntraNodeError(f"cannot listen on {_printable(name)}: {e}") from None
        holder = _holder(name)
        who = "a process that does not accept connections (find it with `ss -xlp`)" if holder is None else \
            f"uid {holder[1]} pid {holder[0]}" + (" (another user)" if _foreign_user(holder[1]) else
                                                  " (a concurrent run of this job with the same session?)")
        raise IntraNodeError(f"local rank 0 cannot start: its rendezvous socket {_printable(name)} is held by {who}") \
            from None


def _holder(name: bytes) -> tuple[int, int] | None:
    """(pid, uid) of the process listening on ``name``. (Abstract names are per socket type, so
    only a SEQPACKET socket can be in our way.)"""
    with _socket() as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(name)
        except OSError:  # bound, but not listening
            return None
        return _credentials(probe)


def _gather(server: socket.socket, members: dict[int, _Member], size: int, deadline: float,
            timeout_s: float) -> None:
    """Accept until every other local rank sent its hello. Another user's connection is
    dropped unread and rank 0 keeps waiting: anyone can connect to an abstract socket (its name
    is listed in /proc/net/unix), and that must not stop the job. It is named if the wait times
    out."""
    refused: list[tuple[int, int]] = []
    while len(members) < size - 1:
        server.settimeout(_remaining(deadline))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            missing = [r for r in range(1, size) if r not in members]
            raise IntraNodeError(_not_started_message(missing, timeout_s, refused)) from None
        try:
            pid, uid = _credentials(conn)
            if _foreign_user(uid):
                log.warning("refused a connection to the intra-node rendezvous from uid %d (pid %d), another user",
                            uid, pid)
                refused.append((pid, uid))
                conn.close()
                continue
            rank, fd = _hello(conn, pid, members, size, deadline, timeout_s)
        except BaseException:
            conn.close()
            raise
        members[rank] = _Member(conn, pid, fd)


def _hello(conn: socket.socket, pid: int, members: Collection[int], size: int, deadline: float,
           timeout_s: float) -> tuple[int, int]:
    """(local rank, segment descriptor) a member announces; the descriptor is ours if this returns."""
    data, fds = _receive(conn, deadline, 1, f"a local rank (pid {pid})", timeout_s)
    try:
        return _member_rank(data, len(fds), size, members, f"pid {pid}"), fds[0]
    except BaseException:
        _close(fds)
        raise


def _join(name: bytes, own_fd: int, local_rank: int, size: int, deadline: float,
          timeout_s: float) -> dict[int, int]:
    """A local rank other than 0: send our memfd to rank 0, receive everyone's."""
    with _connect(name, deadline, timeout_s) as sock:
        pid, uid = _credentials(sock)
        if _foreign_user(uid):  # a squatter: rank 0 cannot bind this name and fails as well
            raise IntraNodeError(f"the rendezvous socket {_printable(name)} of local rank 0 is held by uid {uid} "
                                 f"pid {pid}, another user: refused to send it our segment")
        who = f"local rank 0 (pid {pid})"
        _send(sock, _HELLO.pack(_RDV_MAGIC, local_rank, size), [own_fd], who)
        data, fds = _receive(sock, deadline, size, who, timeout_s)
    try:
        _check_reply(data, len(fds), size)
    except BaseException:
        _close(fds)
        raise
    os.close(fds[local_rank])  # our own segment, which we have mapped already
    return {r: fd for r, fd in enumerate(fds) if r != local_rank}


def _connect(name: bytes, deadline: float, timeout_s: float) -> socket.socket:
    """Connect to local rank 0, retrying until it listens (it may start later than us)."""
    while True:
        sock = _socket()
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError, BlockingIOError, TimeoutError):
            sock.close()  # not listening yet (or its backlog is full)
        except BaseException:
            sock.close()
            raise
        if time.monotonic() > deadline:
            raise IntraNodeError(_not_started_message([0], timeout_s, []))
        time.sleep(0.01)


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
        self.segments: list[_Segment | None] = [None] * local_world_size
        own, own_fd = _Segment.create(nblocks, self.transport, export, numel if self.transport == "shm" else 0,
                                      name=f"cgxps-n{node_rank}-r{local_rank}")
        self.segments[local_rank] = own
        try:
            peer_fds = _exchange_fds(rendezvous_name(job_id or "default", run_tag, node_rank), own_fd,
                                     local_rank, local_world_size, timeout_s)
        finally:
            os.close(own_fd)  # our mapping keeps the segment; the peers hold their own descriptors
        try:
            self._attach(peer_fds, nblocks, numel)
        finally:
            _close(peer_fds.values())
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
            seg = _Segment.open(fd, f"local rank {r}")
            self._check_peer(r, seg, nblocks, numel)
            self.segments[r] = seg
        self.own.header[2] = 1  # mapped every peer (for debugging: nothing waits on it)

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
