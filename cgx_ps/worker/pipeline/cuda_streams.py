"""Each codec thread's own CUDA stream, so that codec work never waits for backward.

On torch's default stream, every host sync of a codec call (the NaN/overflow flag of an encode,
the payload's copy to the host, the end of a decode) would wait for every backward kernel queued
so far, and the codec threads would block meanwhile: encoding would no longer overlap backward.
So each codec thread runs its calls on a stream of its own (one per thread and device, made on
first use), which first waits, on the GPU, for the event the training thread recorded after it
wrote the block (``BlockPipeline.submit``'s ``ready``): no host wait for it.

Every codec call ends with a host sync of its own stream (``EncodedBlock.to_bytes``, the
decode's ``synchronize``, the intra-node sum's), so what one call wrote is complete before the
next call of the block starts, on whichever codec thread; memory the training thread allocated
is therefore never freed while a codec stream still uses it. CPU blocks run their calls as they
are: ``wrap`` returns them unchanged.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

__all__ = ["CODEC_STREAMS", "CodecStreams"]


class CodecStreams:
    """The codec threads' streams; ``new_stream`` and ``use`` (torch's by default) are injectable
    so that the ordering is tested without a GPU."""

    def __init__(self, new_stream: Callable[[torch.device], Any] | None = None,
                 use: Callable[[Any], Any] | None = None) -> None:
        self._new_stream = new_stream or (lambda device: torch.cuda.Stream(device))
        self._use = use or torch.cuda.stream
        self._local = threading.local()

    def stream(self, device: torch.device) -> Any:
        """This thread's stream on ``device``, the same on every call."""
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        if device not in streams:
            streams[device] = self._new_stream(device)
        return streams[device]

    @contextmanager
    def running(self, device: torch.device, after: Any = None) -> Iterator[Any]:
        """Run the block inside on this thread's stream on ``device``, after ``after`` (an event
        recorded where the block's input was written; None: nothing to wait for)."""
        stream = self.stream(device)
        with self._use(stream):
            if after is not None:
                stream.wait_event(after)
            yield stream

    def wrap(self, fn: Callable, device: torch.device | None, after: Any = None) -> Callable:
        """``fn`` to run on a codec thread: on its stream for a CUDA ``device``, unchanged else."""
        if device is None or device.type != "cuda":
            return fn

        def on_stream(*args):
            with self.running(device, after):
                return fn(*args)

        return on_stream


# The process's codec threads are the engine's one pool: one set of streams for every pipeline.
CODEC_STREAMS = CodecStreams()
