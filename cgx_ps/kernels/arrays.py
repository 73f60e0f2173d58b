"""The arrays the codecs take: numpy arrays, or torch tensors where the caller has torch.

A shard never imports torch: it checks, sums and re-encodes numpy arrays (``summation.py``),
which spares each shard process torch's ~190 MiB and a second or more of CPU at every start.
Workers pass torch tensors: a CPU tensor's memory is viewed as numpy (no copy) and goes to the
same kernels, a CUDA tensor to the CuPy ones. Nothing here imports torch: a caller that holds a
tensor has imported it already.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["device_type", "host_view", "is_tensor", "torch_module"]


def is_tensor(x: Any) -> bool:
    """Is ``x`` a torch tensor? (False, without importing torch, where nothing imported it.)"""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def device_type(x: Any) -> str:
    """"cuda" for a CUDA tensor, else "cpu" (numpy arrays, bytes, CPU tensors)."""
    return x.device.type if is_tensor(x) else "cpu"


def host_view(x: Any) -> np.ndarray:
    """A CPU array's memory as a numpy array: a numpy array as it is, a CPU tensor's ``.numpy()``
    view (writes through to the tensor)."""
    return x.numpy() if is_tensor(x) else x


def torch_module() -> Any:
    """torch, imported on first use: only the plain-torch reference implementation and results
    returned to a caller without an ``out`` need it."""
    import torch

    return torch
