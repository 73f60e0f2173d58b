"""What a worker decides and prepares for its GPU path when it is set up, so that a problem shows
there and not at the first gradient or the first peer mapping:

* ``decide_transport``: how the local ranks reduce. CUDA IPC only where every pair of GPUs the
  local ranks may use can map each other's memory (``torch.cuda.can_device_access_peer``; ranks
  on one GPU always can). PCIe across CPU sockets and many cloud VMs have no peer access, and
  there ``cudaIpcOpenMemHandle`` fails at start; ``auto`` then reduces through host shared
  memory and says why in one log line. A pure function of its inputs, so it is tested on CPU.
* ``compile_cuda_codecs``: the CuPy kernels of every CUDA device that max-min encodes, compiled
  now (NVRTC, or CuPy's disk cache): a CuPy that does not match the driver, or a toolkit NVRTC
  rejects, fails the optimizer's or the hook's setup with a ConfigError naming the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..kernels import Codec
from .config import INTRANODE_TRANSPORTS
from .errors import ConfigError

__all__ = ["TransportChoice", "compile_cuda_codecs", "decide_transport", "kernel_devices", "peer_access_table"]

PeerAccess = Mapping[tuple[int, int], bool]  # (from device, to device) -> can map its memory


@dataclass(frozen=True)
class TransportChoice:
    """How this node's local ranks reduce, and what to tell the user about it."""

    transport: str  # "shm" or "cuda"
    warning: str = ""  # one log line when the choice is not what was asked for, or is risky


def decide_transport(requested: str, device: torch.device, cupy_ok: bool, peer_access: PeerAccess) -> TransportChoice:
    """The intra-node transport for a model on ``device``; ``requested``: CGX_PS_INTRANODE.
    ``peer_access``: the answers for every ordered pair of distinct GPUs the local ranks may use
    (empty for one GPU). ``auto`` takes CUDA IPC for a GPU model when CuPy can make the IPC calls
    and every pair has peer access, else host shared memory; an explicit ``cuda`` is the user's
    word (it warns for pairs without peer access); ``shm`` is always possible. Every local rank
    decides alike when they see the same GPUs (a mismatch is refused when they meet)."""
    if requested not in INTRANODE_TRANSPORTS:
        raise ConfigError(f"CGX_PS_INTRANODE={requested!r} is not one of {', '.join(INTRANODE_TRANSPORTS)}")
    if requested == "shm":
        return TransportChoice("shm")
    if requested == "cuda" and device.type != "cuda":
        raise ConfigError(f"CGX_PS_INTRANODE=cuda needs the model on a GPU, but its parameters are on {device}")
    if device.type != "cuda":
        return TransportChoice("shm")
    blocked = sorted(pair for pair, ok in peer_access.items() if not ok)
    named = ", ".join(f"cuda:{a} -> cuda:{b}" for a, b in blocked)
    if requested == "cuda":
        if blocked:
            return TransportChoice("cuda", f"CGX_PS_INTRANODE=cuda although these GPUs cannot access each other's "
                                           f"memory ({named}): mapping a peer's buffer may fail at start")
        return TransportChoice("cuda")
    if not cupy_ok:
        return TransportChoice("shm", "CUDA IPC needs CuPy (pip install 'cgx-ps[cuda12]'); local ranks reduce "
                                      "through host shared memory instead")
    if blocked:
        return TransportChoice("shm", f"local ranks reduce through host shared memory, not CUDA IPC: these GPUs "
                                      f"cannot access each other's memory ({named}); set CGX_PS_INTRANODE=cuda "
                                      f"to try CUDA IPC anyway, or CUDA_VISIBLE_DEVICES to GPUs that can")
    return TransportChoice("cuda")


def peer_access_table(device_count: int,
                      can_access: Callable[[int, int], bool] | None = None) -> dict[tuple[int, int], bool]:
    """``torch.cuda.can_device_access_peer`` for every ordered pair of the visible GPUs: the
    local ranks may be on any of them (each rank knows only its own device before they meet)."""
    ask = can_access or torch.cuda.can_device_access_peer
    return {(a, b): bool(ask(a, b)) for a in range(device_count) for b in range(device_count) if a != b}


def kernel_devices(codecs: Sequence[Codec | int], devices: Sequence[torch.device]) -> list[torch.device]:
    """The CUDA devices that run the CuPy kernels: those of the blocks (``codecs[i]`` on
    ``devices[i]``) that are max-min encoded (the float codecs are plain torch casts)."""
    found = {d for c, d in zip(codecs, devices) if d.type == "cuda" and Codec(int(c)) == Codec.MAXMIN}
    return sorted(found, key=lambda d: -1 if d.index is None else d.index)


def compile_cuda_codecs(codecs: Sequence[Codec | int], devices: Sequence[torch.device],
                        compile_for: Callable[[torch.device], None] | None = None) -> list[torch.device]:
    """Compile the CuPy kernels for every device of ``kernel_devices`` now; the devices done.
    Raises ConfigError naming the device and the cause (no CuPy, an NVRTC or driver error)."""
    if compile_for is None:
        from ..kernels import cuda

        compile_for = cuda.compile_kernels
    done = []
    for device in kernel_devices(codecs, devices):
        try:
            compile_for(device)
        except Exception as exc:  # ImportError, cupy's CompileException, CUDA driver errors
            raise ConfigError(f"the CUDA codec kernels cannot be prepared on {device}: {type(exc).__name__}: "
                              f"{_first_lines(str(exc))}; the gradients there are max-min encoded by them. "
                              f"Install the CuPy that matches the driver and torch's CUDA "
                              f"('cgx-ps[cuda12]' or 'cgx-ps[cuda13]'), or compress with fp16/bf16") from exc
        done.append(device)
    return done


def _first_lines(text: str, lines: int = 8) -> str:
    """An NVRTC log can run to pages: its first lines name the error."""
    kept = text.strip().splitlines()
    return "\n".join(kept[:lines]) + ("\n..." if len(kept) > lines else "")
