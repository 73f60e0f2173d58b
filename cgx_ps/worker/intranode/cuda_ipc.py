"""CUDA IPC data plane for the intra-node reduction: the local ranks' block buffers stay on
their GPUs and are read by the other local ranks' processes directly.

Each local rank allocates one flat float32 buffer on its GPU holding all of its blocks, plus one
interprocess CUDA event per block. It exports them as a small JSON record that goes into its
shared-memory control segment (see ``intranode.py``), and maps every peer's record:

* Memory: ``cudaIpcGetMemHandle`` takes the *base pointer* of a ``cudaMalloc`` allocation, and
  PyTorch's caching allocator sub-allocates tensors out of larger segments, so the record carries
  the handle of the base allocation **and the buffer's byte offset from it**
  (``cuMemGetAddressRange``). The importer opens the handle in its *own* device's context
  (``cudaIpcOpenMemHandle`` with lazy peer access, which works for a peer on another GPU, even
  one this process cannot see) and views ``[offset, offset + size)`` of it: its kernels read
  the peer's memory directly, over NVLink/PCIe when the peer is on another GPU. No context is
  created on any other GPU.
* Ordering: a rank records its event for block ``b`` on its stream after it wrote the block
  (its gradient, or as owner the decoded result) and only then raises the matching flag in
  shared memory; a reader makes its own stream wait on that event before touching the bytes,
  so the wait happens on the GPU, not on the host.
* Files: none of ours beyond the control segments. (The CUDA driver's IPC events rely on a
  shared ``/dev/shm`` between the processes: the ranks of a node must share an IPC namespace,
  e.g. one Kubernetes pod, as ``deploy/`` arranges.) torch.multiprocessing's CUDA sharing would
  add reference-counter files there that a crash leaves behind.

Needs CuPy (the ``cuda12``/``cuda13`` extras, as the GPU codec does) for the IPC calls.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass

import torch

from ..errors import IntraNodeError

__all__ = ["CudaIpcBuffer", "PeerBuffer", "allocation_base"]

_NO_IPC_HINT = "set CGX_PS_INTRANODE=shm to reduce through host shared memory instead"


def _cupy_runtime():
    try:
        from cupy.cuda import runtime
    except Exception as e:  # absent, or cannot load its CUDA libraries
        raise IntraNodeError(f"CUDA IPC needs CuPy (pip install 'cgx-ps[cuda12]'), which failed to import: {e}; "
                             f"or {_NO_IPC_HINT}") from e
    return runtime


def allocation_base(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation ``ptr`` lies in (``cuMemGetAddressRange``)."""
    driver = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise IntraNodeError(f"cuMemGetAddressRange failed with CUresult {rc} for pointer {ptr:#x}")
    return base.value, size.value


def _check_mapped(data: torch.Tensor, address: int, device: torch.device) -> None:
    """The peer's buffer must be a view of the mapping on our device: a copy (``torch.as_tensor``
    infers the device from the pointer and may copy across devices) would sum a stale snapshot."""
    if data.data_ptr() != address or data.device != device:
        raise IntraNodeError(f"a peer's mapped GPU buffer came back as a copy ({data.device}, address "
                             f"{data.data_ptr():#x}) instead of a view of the mapping ({device}, {address:#x}); "
                             f"{_NO_IPC_HINT}")


@dataclass
class PeerBuffer:
    """Another local rank's buffer and events, mapped into this process on our own device."""

    data: torch.Tensor
    events: list[torch.cuda.Event]
    base: int  # the opened IPC mapping, to close
    device: torch.device  # ours: the mapping and the events were opened in its context

    def wait(self, block_id: int) -> None:
        """Make our stream wait until the peer's last write of the block is done."""
        torch.cuda.current_stream(self.device).wait_event(self.events[block_id])

    def close(self) -> None:
        """Unmap, in the context the mapping was opened in (after our last read of it: on any
        stream of ours, the codec threads' included, hence the whole device is synchronized)."""
        if not self.base:
            return
        import cupy

        with torch.cuda.device(self.device), cupy.cuda.Device(self.device.index):
            torch.cuda.synchronize(self.device)
            self.data, self.events = torch.empty(0), []
            base, self.base = self.base, 0
            _cupy_runtime().ipcCloseMemHandle(base)


class CudaIpcBuffer:
    """This rank's buffer of all blocks on ``device`` and one interprocess event per block."""

    def __init__(self, numel: int, nblocks: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise IntraNodeError(f"CUDA IPC needs a CUDA device, got {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        with torch.cuda.device(self.device):
            self.data = torch.zeros(max(numel, 1), dtype=torch.float32, device=self.device)
            # interprocess events cannot time; a first record creates each on our device
            self.events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                           for _ in range(nblocks)]
            for event in self.events:
                event.record()
            torch.cuda.current_stream(self.device).synchronize()

    def written(self, block_id: int) -> None:
        """Our stream's writes to the block so far are what peers may read next."""
        self.events[block_id].record(torch.cuda.current_stream(self.device))

    def export(self) -> bytes:
        """The record peers need to map our buffer and events (handle + offset from the base)."""
        runtime = _cupy_runtime()
        ptr = self.data.data_ptr()
        with torch.cuda.device(self.device):  # the same thread that allocated: its context is current
            base, size = allocation_base(ptr)
            try:
                handle = runtime.ipcGetMemHandle(base)  # handles name base allocations only
            except Exception as e:
                raise IntraNodeError(f"cannot export the GPU buffer over CUDA IPC ({e}): PyTorch allocator modes "
                                     f"such as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or "
                                     f"backend:cudaMallocAsync allocate memory that cannot be shared this way; "
                                     f"unset them or {_NO_IPC_HINT}") from e
        record = {
            "device_uuid": str(torch.cuda.get_device_properties(self.device).uuid),
            "handle": bytes(handle).hex(), "offset_bytes": ptr - base, "allocation_bytes": size,
            "numel": self.data.numel(),
            "events": [bytes(e.ipc_handle()).hex() for e in self.events],
        }
        return json.dumps(record).encode()

    @staticmethod
    def open(record: bytes, nblocks: int, device: torch.device) -> PeerBuffer:
        """Map a peer's exported buffer and events into this process, in ``device``'s context
        (ours: the kernels that read the peer's memory run there)."""
        r: dict = {}
        try:
            r = json.loads(record)
            if len(r["events"]) != nblocks:
                raise IntraNodeError(f"peer exported {len(r['events'])} block events, expected {nblocks}: "
                                     f"do the local ranks build the same model?")
            if r["offset_bytes"] + 4 * r["numel"] > r["allocation_bytes"]:
                raise IntraNodeError(f"peer's buffer ({r['numel']} floats at offset {r['offset_bytes']}) does not "
                                     f"fit its allocation of {r['allocation_bytes']} bytes")
            runtime = _cupy_runtime()
            import cupy

            index = device.index
            with torch.cuda.device(index), cupy.cuda.Device(index):
                base = runtime.ipcOpenMemHandle(bytes.fromhex(r["handle"]))  # lazy peer access
                try:
                    memory = cupy.cuda.UnownedMemory(base, r["allocation_bytes"], owner=None, device_id=index)
                    view = cupy.ndarray((r["numel"],), dtype=cupy.float32,
                                        memptr=cupy.cuda.MemoryPointer(memory, r["offset_bytes"]))
                    data = torch.as_tensor(view, device=device)  # zero-copy (CUDA array interface)
                    _check_mapped(data, base + r["offset_bytes"], device)
                    events = [torch.cuda.Event.from_ipc_handle(index, bytes.fromhex(h)) for h in r["events"]]
                except BaseException:
                    runtime.ipcCloseMemHandle(base)
                    raise
        except IntraNodeError:
            raise
        except Exception as e:  # JSON, CUDA or CuPy errors: name what failed
            raise IntraNodeError(f"cannot map another local rank's GPU buffer (on GPU {r.get('device_uuid', '?')}) over "
                                 f"CUDA IPC: {e!r}; or {_NO_IPC_HINT}") from e
        return PeerBuffer(data, events, base, device)
