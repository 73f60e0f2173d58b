"""How a node's local ranks get each other's segments (``segment.py``), once, at start-up.

The segments' file descriptors travel over a Unix socket in the Linux abstract namespace
(``rendezvous_name``: uid, a hash of job id and the run's random tag, node rank). Local rank 0
listens; every other rank connects and sends its memfd; rank 0 then sends every rank all of them
(SCM_RIGHTS), and the sockets are closed. Both ends check the other's uid with SO_PEERCRED, so
another local user can neither plant a segment nor obtain ours; the peers' headers are checked
before anything is summed. Abstract sockets and memfds have no file, so nothing is left behind
whatever rank is killed, and when: the kernel frees them with their last process. A local rank
that dies or stalls makes the others fail within the timeout with an error that names it.
"""

from __future__ import annotations

import array
import errno
import hashlib
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Collection

from ..errors import IntraNodeError

__all__ = ["close_fds", "exchange_fds", "rendezvous_name"]

log = logging.getLogger(__name__)
_RDV_MAGIC = b"CGXPSRDV"
_HELLO = struct.Struct("<8sII")  # member -> local rank 0: magic, local rank, local world size (+ its memfd)
_REPLY = struct.Struct("<8sI")  # local rank 0 -> member: magic, local world size (+ every rank's memfd)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SCM_MAX_FD = 253  # the kernel's limit of descriptors in one SCM_RIGHTS message


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
        close_fds(fds)
        raise IntraNodeError(f"{who} closed the connection during start-up: killed, or failed (see its own error)"
                             if not data else f"{who} sent an oversized start-up message, not a cgx-ps local rank")
    return data, fds


def close_fds(fds: Collection[int]) -> None:
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


def exchange_fds(name: bytes, own_fd: int, local_rank: int, size: int, timeout_s: float) -> dict[int, int]:
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
            close_fds([m.fd for m in members.values()])
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
        close_fds(fds)
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
        close_fds(fds)
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
