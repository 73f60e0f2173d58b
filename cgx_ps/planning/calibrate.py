"""Measure the speeds the performance model needs on this machine (``cgx-ps plan --calibrate``).

    speeds = measure()        # about half a second: codec kernels, a shard's sum, TCP on loopback

What is timed is CPU time (all of this process's threads), since the model charges CPU-seconds per element or
byte and divides by the threads that share the work:

- encode: 4-bit stochastic max-min quantization of a 4 M-element gradient (the worker's push);
- decode: dequantize-accumulate of its wire bytes (the worker's result);
- shard ingest: what a shard does with one block's pushes from 4 nodes (as ``benchmarks/server.py --nodes 4``
  measures the whole shard): receive them over TCP, keep and sum them and encode the result once
  (``kernels.EncodedSum``, the shard's own path), send the result to each node; compressed bytes in per
  CPU-second. The shard's event loop and framing are not in it (the whole shard, ``benchmarks/server.py``:
  1081 MB/s on the raw data plane, on an idle machine);
- TCP: bytes sent plus received per CPU-second over a loopback connection.

The device figures (fp16 casts, PowerSGD's matmuls) keep their defaults: they are the GPU's, not this CPU's.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from typing import Callable

from .model import Speeds

__all__ = ["measure"]

_NUMEL = 1 << 20  # elements: one of the worker's 4 MiB blocks of fp32
_REPEATS = 5
_NODES = 4


def _cpu_seconds(fn: Callable[[], object], repeats: int = _REPEATS) -> float:
    """The least CPU time (process-wide: the kernels' thread pool included) of ``repeats`` calls, after one
    untimed call that warms caches and the pool."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return max(best, 1e-6)


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    for s in (client, peer):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, peer


def _transfer(sender: socket.socket, receiver: socket.socket, payload: bytes, into: bytearray) -> None:
    """Send ``payload`` on one end while this thread reads it on the other (a loopback buffer is smaller)."""
    thread = threading.Thread(target=sender.sendall, args=(payload,))
    thread.start()
    view, got = memoryview(into), 0
    while got < len(payload):
        got += receiver.recv_into(view[got:len(payload)])
    thread.join()


def measure() -> Speeds:
    """This machine's codec, shard and TCP speeds (``Speeds``), the device figures left at their defaults."""
    import torch

    from ..kernels import Codec, EncodedSum, dequantize, quantize
    from ..kernels.cpu import num_threads

    grad = torch.randn(_NUMEL, generator=torch.Generator().manual_seed(0))
    block = quantize(grad, bits=4, bucket_size=1024, stochastic=True, seed=1)
    payload = bytes(block.to_bytes())
    acc = torch.zeros(_NUMEL)
    encode_cpu = _cpu_seconds(lambda: quantize(grad, bits=4, bucket_size=1024, stochastic=True, seed=1))
    decode_cpu = _cpu_seconds(lambda: dequantize(payload, out=acc, accumulate=True))

    client, peer = _loopback_pair()
    buffers = [bytearray(len(payload)) for _ in range(_NODES)]
    try:
        tcp_cpu = _cpu_seconds(lambda: _transfer(client, peer, payload, buffers[0]))
        total = EncodedSum(_NUMEL, parts=_NODES)

        def shard_round() -> None:
            for buffer in buffers:  # the nodes' pushes arrive and are kept, then summed once
                _transfer(client, peer, payload, buffer)
                total.add(bytes(buffer))
            result = bytes(total.encode(Codec.MAXMIN, bits=4, bucket_size=1024, stochastic=True, seed=2).to_bytes())
            total.clear()
            for _ in buffers:
                _transfer(peer, client, result, buffers[0])

        shard_cpu = _cpu_seconds(shard_round)
    finally:
        client.close()
        peer.close()
    return replace(Speeds(), encode_eps=_NUMEL / encode_cpu, decode_eps=_NUMEL / decode_cpu,
                   codec_threads=num_threads(), shard_ingest_Bps=_NODES * len(payload) / shard_cpu,
                   net_cpu_Bps=2 * len(payload) / tcp_cpu)
