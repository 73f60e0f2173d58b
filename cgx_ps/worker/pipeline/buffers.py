"""Where gradients wait between a front end and the wire: a flat float32 buffer per block.

The buffers are views of one flat tensor per device, blocks end to end in block order (the
node's shared memory or IPC-exported GPU memory when the node's ranks reduce together:
``NodeReducer.buffer``). A front end's gradients are copied in by ``fill`` and the averages
copied back by ``copy_out``, segment by segment. A tensor's elements are consecutive in its
blocks and its blocks consecutive in the layout, so a tensor is one view of the buffers too:
``tensor(name)`` gives its averaged gradient without a copy (adaptive bits read each step's).

Fewer bytes touched: where a block's gradients already lie end to end in one float32 tensor
(a slice of one large ``.grad``; a DDP bucket), ``span`` gives that memory and the pipeline
encodes from it and decodes into it, skipping both copies (``work_in_place`` says when that is
allowed at all). ``fill`` and ``copy_out`` skip a segment whose source and destination are
already the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...v1 import ps_pb2
from ..intranode.reduction import NodeReducer

__all__ = ["BlockBuffers", "InPlace", "TensorOf", "adjacent_span", "work_in_place"]

TensorOf = Callable[[str], "torch.Tensor | None"]  # a front end's tensors by name (None: it has none)


@dataclass(frozen=True)
class InPlace:
    """Whether blocks may be encoded from and decoded into the front end's own gradient memory."""

    allowed: bool
    reason: str  # why not (empty when allowed)


def work_in_place(intranode: bool, tuned: bool) -> InPlace:
    """Decide once per pipeline whether a block may work on the front end's memory.

    Not with intra-node reduction: the node's ranks reduce through their block buffers (shared
    memory, CUDA IPC), so gradients must be in them. Not with a tuner that reads gradients
    (``tuned``: adaptive bits): it reads each step's averaged gradients from the block buffers
    (``tensor``) after the step, when a DDP bucket already holds the next step's gradients (auto
    mode's tuner reads only step figures). Everything else (error feedback, warm-up, uncompressed
    tensors, checkpoints) works on any float32 memory."""
    if intranode:
        return InPlace(False, "intra-node reduction reads every local rank's gradients from its block buffers")
    if tuned:
        return InPlace(False, "the tuner (adaptive bits) reads the averaged gradients from the block buffers")
    return InPlace(True, "")


def adjacent_span(pieces: Sequence["torch.Tensor | None"]) -> "torch.Tensor | None":
    """One flat view covering ``pieces`` when they are float32, on one device and end to end in
    one storage, in order (a slice of one contiguous gradient; a DDP bucket's tensors); else None
    (a missing gradient, another dtype, a non-contiguous tensor, or pieces apart: copy them)."""
    if not pieces or any(p is None for p in pieces):
        return None
    first = pieces[0]
    storage = first.untyped_storage().data_ptr()
    for prev, piece in zip([None, *pieces], pieces):
        if piece.dtype != torch.float32 or piece.device != first.device or not piece.is_contiguous():
            return None
        if piece.untyped_storage().data_ptr() != storage:
            return None
        if prev is not None and piece.storage_offset() != prev.storage_offset() + prev.numel():
            return None
    return first.as_strided((sum(p.numel() for p in pieces),), (1,))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same elements (a gradient that is a view of the block buffer)."""
    return (a.dtype == b.dtype and a.device == b.device and a.numel() == b.numel()
            and a.data_ptr() == b.data_ptr() and a.is_contiguous() and b.is_contiguous())


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

    def span(self, block_id: int, grad_of: TensorOf) -> "torch.Tensor | None":
        """The block's gradients as one flat float32 view of the front end's memory, where they
        lie end to end there (``adjacent_span``); None: they must be copied in (``fill``)."""
        pieces = []
        for name, t_off, _, n in self._segments[block_id]:
            grad = grad_of(name)
            if grad is None or not grad.is_contiguous():  # reshape would copy: not the gradient's memory
                return None
            pieces.append(grad.detach().view(-1)[t_off:t_off + n])
        return adjacent_span(pieces)

    def fill(self, block_id: int, grad_of: TensorOf) -> None:
        """Copy the block's share of each tensor's gradient in (zeros for a tensor without one)."""
        buffer = self._views[block_id]
        for name, t_off, b_off, n in self._segments[block_id]:
            grad = grad_of(name)
            if grad is None:
                buffer[b_off:b_off + n].zero_()  # unused in this step: contributes zeros
                continue
            source = grad.detach().reshape(-1)[t_off:t_off + n]
            if not _same_memory(source, buffer[b_off:b_off + n]):  # a .grad viewing the buffer is there
                buffer[b_off:b_off + n].copy_(source)

    def copy_out(self, block_id: int, out_of: TensorOf, source: "torch.Tensor | None" = None) -> None:
        """Copy the block (or ``source``, the memory it was decoded into) into ``out_of(name)`` of
        each of its tensors (skipped where None, or where that is the same memory)."""
        buffer = self._views[block_id] if source is None else source
        for name, t_off, b_off, n in self._segments[block_id]:
            out = out_of(name)
            if out is None:
                continue
            target = out.view(-1)[t_off:t_off + n]
            if not _same_memory(target, buffer[b_off:b_off + n]):
                target.copy_(buffer[b_off:b_off + n])

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor's elements, flat: a view where its pieces are adjacent in one storage (always,
        with one device), else a copy."""
        parts = [self._views[b][at:at + n] for b, at, n in self._pieces[name]]
        first = parts[0]
        if all(p.device == first.device and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and p.storage_offset() == q.storage_offset() + q.numel() for q, p in zip(parts, parts[1:])):
            return first.as_strided((sum(p.numel() for p in parts),), (1,))
        return torch.cat(parts)
