"""A local rank's shared-memory segment: what the node's ranks see of each other's blocks.

Two data planes carry the block buffers, one control plane orders them:

* control (always): one shared-memory segment per local rank, an anonymous sealed ``memfd``
  (no file name anywhere), with a header (magic, pid, transport, sizes) and three flags per
  block: ``ready`` (my gradient is in my buffer), ``done`` (owner: the result is in my buffer),
  ``consumed`` (I copied the owner's result). Flags hold the step number + 1, so they never
  need resetting. One error slot: the first error that ended this rank's exchange with the
  shards (``post_error``), so the node's other ranks raise it instead of a timeout of their own.
  Two vote slots: a value each rank posts for a decision the node's ranks must take alike
  (``post_vote``; ``NodeReducer.vote`` reads every rank's).
* data, ``shm``: every block's float32 buffer lives in the same segment; peers read it directly.
* data, ``cuda``: buffers stay on the GPUs; the segment carries the CUDA IPC memory handle, its
  offset from the allocation base and one IPC event handle per block (see ``cuda_ipc.py``).
  A flag is raised only after the event that orders the GPU writes it announces was recorded.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np
import torch

from ..errors import IntraNodeError
from .shm_flags import load_acquire, store_release

__all__ = ["Segment", "TRANSPORT_CODES"]

_MAGIC = 0x43475850534E4F44  # "CGXPSNOD"
# header words: magic, pid, mapped (diagnostic), transport, blocks, export bytes, host floats, detached,
# bytes in the error slot (0: none posted), then the two vote slots' tags and their two values
_HEADER_WORDS = 13
_ERROR_WORD = 8
_VOTE_TAGS = 9  # a vote's tag (its number, from 1) in slot tag % 2, its value two words on
ERROR_BYTES = 1024  # "Kind\0message", UTF-8, cut to fit: a shard error's message is a few hundred bytes
# a peer must not be able to shrink its segment under our mapping (reads past the end are SIGBUS)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
TRANSPORT_CODES = {"shm": 1, "cuda": 2}
_TRANSPORT_NAME = {v: k for k, v in TRANSPORT_CODES.items()}


class Segment:
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
        self._error_at = 8 * (_HEADER_WORDS + 3 * nblocks)
        at = self._export_at(nblocks)
        self.export = bytes(mapping[at:at + export_len])
        at += -(-export_len // 8) * 8
        self.data = torch.frombuffer(mapping, dtype=torch.float32, offset=at, count=host_numel) \
            if host_numel else torch.zeros(0)

    @classmethod
    def create(cls, nblocks: int, transport: str = "shm", export: bytes = b"", host_numel: int = 0,
               name: str = "cgxps-segment") -> tuple["Segment", int]:
        """A new segment of this process and its memfd (to send to the peers, then close)."""
        size = cls._size(nblocks, len(export), host_numel)
        fd = _sealed_memfd(name, size)
        try:
            mapping = mmap.mmap(fd, size)
            at = cls._export_at(nblocks)
            mapping[at:at + len(export)] = export
            # complete before anyone can see it: it leaves this process only after this
            np.frombuffer(mapping, dtype=np.int64, count=_HEADER_WORDS)[:] = [
                _MAGIC, os.getpid(), 0, TRANSPORT_CODES[transport], nblocks, len(export), host_numel, 0, 0, 0, 0, 0, 0]
            return cls(mapping, "this rank"), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, fd: int, who: str) -> "Segment":
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
        return 8 * (_HEADER_WORDS + 3 * nblocks) + ERROR_BYTES

    @staticmethod
    def _size(nblocks: int, export_len: int, host_numel: int) -> int:
        return Segment._export_at(nblocks) + -(-export_len // 8) * 8 + 4 * host_numel

    # ---- the error slot: written once by its rank, read by the others ------------------------------

    def post_error(self, kind: str, message: str) -> None:
        """Ours only: record the error that ended our exchange; the first one stays."""
        if self.header[_ERROR_WORD]:
            return
        text = f"{kind}\0{message}".encode(errors="replace")[:ERROR_BYTES]
        self.map[self._error_at:self._error_at + len(text)] = text
        store_release(self.header, _ERROR_WORD, len(text))  # the text is visible before its length

    def posted_error(self) -> tuple[str, str] | None:
        """(kind, message) a rank posted, or None. A peer is another process of our uid (checked
        at the rendezvous), but its slot is still read within bounds and decoded leniently."""
        length = load_acquire(self.header, _ERROR_WORD)
        if not 0 < length <= ERROR_BYTES:
            return None
        kind, _, message = bytes(self.map[self._error_at:self._error_at + length]).decode(errors="replace") \
            .partition("\0")
        return kind[:64], message

    # ---- the vote slots: a value for a decision the node's ranks take alike ------------------------

    def post_vote(self, tag: int, value: int) -> None:
        """Ours only: this rank's value of vote ``tag`` (1, 2, ...). Two slots suffice: a rank posts
        vote t + 2 only after reading every rank's t + 1, which each posts after reading t."""
        slot = _VOTE_TAGS + tag % 2
        self.header[slot + 2] = value
        store_release(self.header, slot, tag)  # the value is visible before its tag

    def vote(self, tag: int) -> int | None:
        """This rank's value of vote ``tag``, or None while it has not posted it."""
        slot = _VOTE_TAGS + tag % 2
        return int(self.header[slot + 2]) if load_acquire(self.header, slot) == tag else None

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
