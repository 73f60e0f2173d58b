"""Where gradients wait between a front end and the wire: a flat float32 buffer per block.

The buffers are views of one flat tensor per device, blocks end to end in block order (the
node's shared memory or IPC-exported GPU memory when the node's ranks reduce together:
``NodeReducer.buffer``). A front end's gradients are copied in by ``fill`` and the averages
copied back by ``copy_out``, segment by segment. A tensor's elements are consecutive in its
blocks and its blocks consecutive in the layout, so a tensor is one view of the buffers too:
``tensor(name)`` gives its averaged gradient without a copy (adaptive bits read each step's).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..v1 import ps_pb2
from .intranode import NodeReducer

__all__ = ["BlockBuffers", "TensorOf"]

TensorOf = Callable[[str], "torch.Tensor | None"]  # a front end's tensors by name (None: it has none)


class BlockBuffers:
    def __init__(self, layout: ps_pb2.Layout, devices: Sequence[torch.device],
                 reducer: NodeReducer | None = None) -> None:
        """``devices[b]``: where block ``b`` lives (where its first tensor is)."""
        if reducer is not None:
            self._views = [reducer.buffer(b.block_id) for b in layout.blocks]
        else:
            sizes: dict[torch.device, int] = {}
            for block, device in zip(layout.blocks, devices):
                sizes[device] = sizes.get(device, 0) + block.numel
            flat = {device: torch.zeros(n, dtype=torch.float32, device=device) for device, n in sizes.items()}
            at = dict.fromkeys(sizes, 0)
            self._views = []
            for block, device in zip(layout.blocks, devices):
                self._views.append(flat[device][at[device]:at[device] + block.numel])
                at[device] += block.numel
        # per block: (tensor name, offset in the tensor, offset in the buffer, numel)
        self._segments: list[list[tuple[str, int, int, int]]] = []
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}  # tensor -> (block, offset in buffer, numel)
        for block in layout.blocks:
            segments, at = [], 0
            for seg in block.segments:
                name = layout.tensors[seg.tensor_index].name
                segments.append((name, seg.offset, at, seg.numel))
                self._pieces.setdefault(name, []).append((block.block_id, at, seg.numel))
                at += seg.numel
            self._segments.append(segments)

    def __getitem__(self, block_id: int) -> torch.Tensor:
        return self._views[block_id]

    def tensors_in(self, block_id: int) -> list[str]:
        return [name for name, *_ in self._segments[block_id]]

    def fill(self, block_id: int, grad_of: TensorOf) -> None:
        """Copy the block's share of each tensor's gradient in (zeros for a tensor without one)."""
        buffer = self._views[block_id]
        for name, t_off, b_off, n in self._segments[block_id]:
            grad = grad_of(name)
            if grad is None:
                buffer[b_off:b_off + n].zero_()  # unused in this step: contributes zeros
            else:
                buffer[b_off:b_off + n].copy_(grad.detach().reshape(-1)[t_off:t_off + n])

    def copy_out(self, block_id: int, out_of: TensorOf) -> None:
        """Copy the block into ``out_of(name)`` of each of its tensors (skipped where None)."""
        buffer = self._views[block_id]
        for name, t_off, b_off, n in self._segments[block_id]:
            out = out_of(name)
            if out is not None:
                out.view(-1)[t_off:t_off + n].copy_(buffer[b_off:b_off + n])

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor's elements, flat: a view where its pieces are adjacent in one storage (always,
        with one device), else a copy."""
        parts = [self._views[b][at:at + n] for b, at, n in self._pieces[name]]
        first = parts[0]
        if all(p.device == first.device and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and p.storage_offset() == q.storage_offset() + q.numel() for q, p in zip(parts, parts[1:])):
            return first.as_strided((sum(p.numel() for p in parts),), (1,))
        return torch.cat(parts)
