"""A performance model of one data-parallel training step, DDP against cgx-ps, as pure functions.

Dataclasses in (``Workload``, ``Cluster``, ``Speeds``), a ``Prediction`` out, with the breakdown that explains
it. No clock, no I/O, no torch: the same arguments always give the same answer (``calibrate.py`` measures the
speeds, ``shapes.py`` builds workloads).

The step, after Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems"
(MLSys '22, section 3): forward, then backward, during which gradients become ready tensor by tensor and are
sent bucket by bucket (DDP) or block by block (cgx-ps) through a pipeline of stages (cast or encode, the link,
the shard, decode); the step ends when the last result is back::

    step = compute + max(0, last result - end of backward)

Each stage is a FIFO server of its own (the link, the shard, encode, decode); an item enters a stage when it
has left the previous one and the stage has finished the item before (``pipeline_finish``). Link times per item:

- ring allreduce (DDP, gloo or NCCL): 2 (N - 1) / N * bytes per rank each way, N ranks (Patarasuk & Yuan,
  "Bandwidth optimal all-reduce algorithms", JPDC 2009), plus 2 (N - 1) message latencies;
- a parameter server with S dedicated shard hosts: max(c M / B, n c M / (S B)) per direction for n nodes
  (BytePS, Jiang et al., OSDI '20, section 3.1: the shards' links must add up to the workers');
- shards colocated one per node (S = n): 2 c M (n - 1) / n each way per host (its pushes to the other
  shards plus its shard's results to the other nodes).

Assumptions (docs/performance-model.md): links are full duplex and every host has the same rate; blocks are
spread evenly over the shards; the worker codec runs on the CPU kernels at the measured speed; a shard's
CPU takes in ``shard_ingest_Bps`` of compressed pushes per CPU-second on ``shard_cores`` cores; tensors
that the worker sends uncompressed (``uncompressed``) travel as fp32; the hosts' CPUs do not slow each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

__all__ = [
    "Cluster", "OPTIONS", "Prediction", "Speeds", "Tensor", "Workload", "DDP_BUCKET_BYTES", "CGX_BLOCK_BYTES",
    "MIN_COMPRESSED_NUMEL", "compressed_bytes", "uncompressed", "ring_seconds", "ps_link_seconds",
    "pipeline_finish", "predict", "predict_all", "shards_needed",
]

OPTIONS = ("ddp-fp32", "ddp-fp16", "ddp-powersgd", "cgx-8bit", "cgx-4bit", "cgx-2bit")
DDP_BUCKET_BYTES = 25 << 20  # torch DDP's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket: small, so the first allreduce starts early
CGX_BLOCK_BYTES = 4 << 20  # fp32 bytes per block: the worker layout's DEFAULT_BLOCK_BYTES
MIN_COMPRESSED_NUMEL = 1024  # cgx_ps.worker.Compression.min_numel: smaller tensors go as fp32
BUCKET_SIZE = 1024  # elements per max-min bucket (Compression.bucket_size)
HEADER_BYTES = 32  # cgx_ps/kernels/wire.py HEADER_SIZE, one per block
POWERSGD_RANK = 4


@dataclass(frozen=True)
class Tensor:
    """One parameter's gradient. ``compute``: the share of backward spent before it is ready, in any unit
    (FLOPs, parameters); None counts its elements."""

    name: str
    shape: tuple[int, ...]
    compute: float | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Workload:
    """A model as the network sees it: its gradients in the order backward produces them, and one step's
    compute on one GPU. ``overlap``: the share of ``compute_s`` during which gradients are produced and can be
    sent (the backward pass, about 2/3 of a step: backward costs about twice forward)."""

    name: str
    tensors: tuple[Tensor, ...]
    compute_s: float
    overlap: float = 2 / 3
    ddp_bucket_bytes: int | None = None  # DDP's bucket_cap_mb; None: its default (a 1 MiB first bucket, then 25)
    block_bytes: int = CGX_BLOCK_BYTES  # cgx-ps's block size (block_bytes=), fp32 bytes

    def __post_init__(self) -> None:
        if not self.tensors or self.compute_s < 0 or not 0 <= self.overlap <= 1 or self.block_bytes < 4 \
                or (self.ddp_bucket_bytes is not None and self.ddp_bucket_bytes < 1):
            raise ValueError(f"a workload needs tensors, compute_s >= 0, overlap in [0, 1] and positive bucket and "
                             f"block sizes: {self.name}")

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` hosts of ``gpus_per_node`` GPUs, each with a full-duplex link of ``link_bps`` bits/s.
    ``shards``: None puts one cgx-ps shard on every node; S puts S shards on S dedicated hosts of the same
    link rate. ``wire_efficiency``: payload over line rate (1448 of 1538 bytes per full Ethernet frame)."""

    nodes: int
    link_bps: float
    gpus_per_node: int = 1
    shards: int | None = None
    wire_efficiency: float = 0.94
    latency_s: float = 50e-6

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.link_bps <= 0 or (self.shards is not None
                                                                               and self.shards < 1):
            raise ValueError(f"nodes, gpus_per_node and shards must be >= 1 and the link rate > 0: {self}")

    @property
    def payload_Bps(self) -> float:
        return self.link_bps / 8 * self.wire_efficiency


@dataclass(frozen=True)
class Speeds:
    """Measured speeds (``calibrate.measure`` on this machine; the defaults were measured on a 2-core
    AMD EPYC by ``benchmarks/codec.py`` and, on an idle machine, ``benchmarks/server.py``)."""

    encode_eps: float = 4327e6 / 2  # elements quantized (4-bit, stochastic) per CPU-second: 4327 M/s on 2 cores
    decode_eps: float = 4497e6 / 2  # elements decoded and accumulated from wire bytes per CPU-second
    copy_eps: float | None = None  # fp32 elements of a result copied out per CPU-second; None: decode_eps
    codec_threads: int = 2  # threads a worker's codec call uses (the kernels' default: one per CPU)
    shard_ingest_Bps: float = 1081e6  # compressed push bytes a shard takes in per CPU-second (raw data plane)
    shard_cores: float = 1.0  # cores a shard's work spreads over
    net_cpu_Bps: float = 4193e6  # bytes a host's TCP stack moves per CPU-second (the shard benchmark's peer)
    # the device (a GPU): fp16 casts (~900 GB/s over 6 bytes per element) and PowerSGD's matmuls (half of an
    # RTX 3090's 35.6 TFLOP/s fp32 peak), each kernel launch ~10 us
    cast_eps: float = 150e9
    device_flops: float = 17.8e12
    kernel_s: float = 10e-6
    intranode_Bps: float = 10e9  # a node's reduction of its GPUs' gradients (shared memory, issue #5)


@dataclass(frozen=True)
class Prediction:
    """One option's predicted step and where its time goes (seconds per step)."""

    name: str
    compression: str
    step_s: float
    compute_s: float
    exposed_comm_s: float  # step - compute: communication that backward did not hide
    link_s: float  # the busiest link direction's bytes over its rate: the link-bound floor of communication
    codec_s: float  # a worker's encode + decode (or casts, PowerSGD's matmuls), wall time
    shard_cpu_s: float  # one shard's CPU per step
    cpu_per_host_s: float  # communication CPU per worker host: codec, TCP stack, its colocated shard
    bytes_per_host: float  # payload bytes on the busiest link direction per step
    bottleneck: str
    shards: int | None = None  # dedicated shard hosts (cgx-ps); None: colocated, one per node
    detail: dict = field(default_factory=dict, compare=False)


def uncompressed(shape: Sequence[int]) -> bool:
    """Whether cgx-ps sends this gradient as fp32: 1-D tensors and those under ``MIN_COMPRESSED_NUMEL``
    elements (biases, norms), as ``cgx_ps.worker.Compression.settings_for`` decides by default."""
    return len(shape) <= 1 or math.prod(shape) < MIN_COMPRESSED_NUMEL


def compressed_bytes(numel: int, bits: int) -> int:
    """Max-min body size (``cgx_ps.kernels.wire.body_size``): a (min, unit) float32 pair per bucket of
    ``BUCKET_SIZE`` elements, then ``bits`` per element."""
    return 8 * -(-numel // BUCKET_SIZE) + (numel * bits + 7) // 8


def ring_seconds(nbytes: float, ranks: int, cluster: Cluster) -> float:
    """One ring allreduce of ``nbytes``: 2 (N - 1) / N * nbytes / B, plus 2 (N - 1) latencies."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / cluster.payload_Bps + 2 * (ranks - 1) * cluster.latency_s


def ps_link_seconds(nbytes: float, cluster: Cluster) -> float:
    """One direction of one block's exchange with the shards, ``nbytes`` pushed per node. Colocated (S = n):
    the host's link carries its pushes to the n - 1 other shards and its shard's results to the n - 1 other
    nodes, (n - 1) / n * nbytes each, in each direction. Dedicated: max(nbytes, n * nbytes / S) / B."""
    n = cluster.nodes
    if cluster.shards is None:
        return (n - 1) / n * nbytes / cluster.payload_Bps + (cluster.latency_s if n > 1 else 0.0)
    return max(nbytes, n * nbytes / cluster.shards) / cluster.payload_Bps + cluster.latency_s


def pipeline_finish(ready: Sequence[float], stages: Sequence[Sequence[tuple[str, float]]]) -> tuple[float, dict]:
    """Tandem FIFO queues: item i (ready at ``ready[i]``) goes through ``stages[i]``, a list of (resource,
    seconds); a stage starts when the item left its previous stage and the resource finished the item before.
    Returns when the last item is done and each resource's busy seconds."""
    free: dict[str, float] = {}
    busy: dict[str, float] = {}
    last = 0.0
    for t, item in zip(ready, stages):
        for resource, seconds in item:
            t = max(t, free.get(resource, 0.0)) + seconds
            free[resource] = t
            busy[resource] = busy.get(resource, 0.0) + seconds
        last = max(last, t)
    return last, busy


def _ready_times(workload: Workload) -> list[float]:
    """When each gradient is ready: forward, then backward split over the tensors by their ``compute``."""
    weights = [t.numel if t.compute is None else t.compute for t in workload.tensors]
    backward = workload.compute_s * workload.overlap
    start, total, done, out = workload.compute_s - backward, sum(weights) or 1.0, 0.0, []
    for w in weights:
        done += w
        out.append(start + backward * done / total)
    return out


def _ddp_buckets(workload: Workload) -> list[tuple[list[Tensor], float]]:
    """DDP's buckets in backward order: whole tensors, closed once a bucket reaches its cap (by default 1 MiB
    for the first, 25 MiB after; an explicit cap for every bucket, as torch's DDP does); each is ready when its
    last tensor is."""
    first, later = ((DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES) if workload.ddp_bucket_bytes is None
                    else (workload.ddp_bucket_bytes,) * 2)
    buckets, current, size, cap = [], [], 0, first
    times = _ready_times(workload)
    for tensor, ready in zip(workload.tensors, times):
        current.append(tensor)
        size += 4 * tensor.numel
        if size >= cap:
            buckets.append((current, ready))
            current, size, cap = [], 0, later
    if current:
        buckets.append((current, times[-1]))
    return buckets


def _cgx_blocks(workload: Workload, compress: bool = True) -> list[tuple[int, bool, float]]:
    """cgx-ps's blocks of at most ``workload.block_bytes`` of fp32, compressed and uncompressed tensors apart (as
    the layout groups them by codec), cut in backward order: (elements, compressed, ready time). The layout
    orders tensors by name; backward order is the approximation that lets blocks go as backward produces them.
    ``compress=False``: every tensor travels as fp32 (compression off)."""
    cap = workload.block_bytes // 4
    blocks: list[tuple[int, bool, float]] = []
    fill, last = {True: 0, False: 0}, {True: 0.0, False: 0.0}
    for tensor, ready in zip(workload.tensors, _ready_times(workload)):
        kind, left = compress and not uncompressed(tensor.shape), tensor.numel
        last[kind] = ready
        while left:
            take = min(left, cap - fill[kind])
            fill[kind] += take
            left -= take
            if fill[kind] == cap:
                blocks.append((cap, kind, ready))
                fill[kind] = 0
    blocks += [(fill[k], k, last[k]) for k in (True, False) if fill[k]]
    return sorted(blocks, key=lambda b: b[2])


def _finish(name: str, compression: str, workload: Workload, end: float, busy: dict, *, link_s: float,
            codec_s: float, shard_cpu_s: float, cpu_s: float, nbytes: float, shards: int | None) -> Prediction:
    backward_end = workload.compute_s
    exposed = max(0.0, end - backward_end)
    step = workload.compute_s + exposed
    if exposed < 0.1 * step:
        bottleneck = "compute"
    else:
        bottleneck = max(busy, key=busy.get) if busy else "compute"
    return Prediction(name, compression, step, workload.compute_s, exposed, link_s, codec_s, shard_cpu_s, cpu_s,
                      nbytes, bottleneck, shards, {"busy_s": dict(busy)})


def _predict_ddp(workload: Workload, cluster: Cluster, speeds: Speeds, precision: str) -> Prediction:
    """DDP over a ring allreduce per bucket, fp32 or with the fp16 hook (a cast before and after)."""
    ranks = cluster.nodes * cluster.gpus_per_node
    width = 4 if precision == "fp32" else 2
    ready, stages = [], []
    for tensors, t in _ddp_buckets(workload):
        numel = sum(x.numel for x in tensors)
        item = [("link", ring_seconds(width * numel, ranks, cluster))]
        if precision == "fp16":
            cast = numel / speeds.cast_eps
            item = [("cast", cast), *item, ("uncast", cast)]
        ready.append(t)
        stages.append(item)
    end, busy = pipeline_finish(ready, stages)
    nbytes = (2 * (ranks - 1) / ranks if ranks > 1 else 0.0) * width * workload.params
    return _finish(f"ddp-{precision}", precision, workload, end, busy, link_s=nbytes / cluster.payload_Bps,
                   codec_s=busy.get("cast", 0.0) + busy.get("uncast", 0.0), shard_cpu_s=0.0,
                   cpu_s=2 * nbytes / speeds.net_cpu_Bps, nbytes=nbytes, shards=None)


def _powersgd_matrix(tensor: Tensor) -> tuple[int, int] | None:
    """The (n, m) matrix PowerSGD compresses a gradient as, or None where it sends the tensor as is: 1-D
    tensors, and matrices whose rank-r factors are not at least 2x smaller (torch's PowerSGDState
    min_compression_rate)."""
    if len(tensor.shape) < 2:
        return None
    n, m = tensor.shape[0], tensor.numel // tensor.shape[0]
    return (n, m) if n * m >= 2 * POWERSGD_RANK * (n + m) else None


def _predict_powersgd(workload: Workload, cluster: Cluster, speeds: Speeds) -> Prediction:
    """DDP + PowerSGD rank r (Vogels et al., NeurIPS '19): per bucket, an allreduce of the uncompressed
    tensors, then of P (n x r per matrix), then of Q (m x r); on the device P = M Q and Q = M^T P and the
    approximation P Q^T (2 n m r FLOPs each) plus one orthogonalization of P (2 n r^2)."""
    ranks, r = cluster.nodes * cluster.gpus_per_node, POWERSGD_RANK
    ready, stages, total = [], [], 0.0
    for tensors, t in _ddp_buckets(workload):
        plain = p_bytes = q_bytes = flops = 0
        kernels = 0
        for x in tensors:
            matrix = _powersgd_matrix(x)
            if matrix is None:
                plain += 4 * x.numel
                continue
            n, m = matrix
            p_bytes, q_bytes = p_bytes + 4 * n * r, q_bytes + 4 * m * r
            flops, kernels = flops + 6 * n * m * r + 2 * n * r * r, kernels + 6
        device = flops / speeds.device_flops + kernels * speeds.kernel_s
        item = [("plain", ring_seconds(plain, ranks, cluster)), ("compress", device / 2),
                ("ring-p", ring_seconds(p_bytes, ranks, cluster)), ("orthogonalize", device / 4),
                ("ring-q", ring_seconds(q_bytes, ranks, cluster)), ("decompress", device / 4)]
        total += plain + p_bytes + q_bytes
        ready.append(t)
        stages.append(item)
    end, busy = pipeline_finish(ready, stages)
    nbytes = (2 * (ranks - 1) / ranks if ranks > 1 else 0.0) * total
    return _finish("ddp-powersgd", f"powersgd-r{r}", workload, end, busy, link_s=nbytes / cluster.payload_Bps,
                   codec_s=sum(busy.get(k, 0.0) for k in ("compress", "orthogonalize", "decompress")),
                   shard_cpu_s=0.0, cpu_s=2 * nbytes / speeds.net_cpu_Bps, nbytes=nbytes, shards=None)


def _predict_cgx(workload: Workload, cluster: Cluster, speeds: Speeds, bits: int | None) -> Prediction:
    """cgx-ps at ``bits`` (None: every block fp32): per block, the node's GPUs reduced (G > 1), encode, push, the shard's sum and
    re-encode of n pushes, the result back, decode. With colocated shards a host's link carries pushes and
    results in each direction at once; in steady state each gets half of it, so both stages take
    2 (n - 1) / n * wire / B per block (``ps_link_seconds`` twice)."""
    n, g = cluster.nodes, cluster.gpus_per_node
    shards = cluster.shards or n
    threads = max(1, speeds.codec_threads)
    share = 2 if cluster.shards is None else 1
    ready, stages, pushed, codec_cpu = [], [], 0, 0.0
    for numel, compressed, t in _cgx_blocks(workload, bits is not None):
        wire = HEADER_BYTES + (compressed_bytes(numel, bits) if compressed and bits else 4 * numel)
        encode = numel / speeds.encode_eps if compressed else 0.0
        decode = numel / (speeds.decode_eps if compressed or speeds.copy_eps is None else speeds.copy_eps)
        link = share * ps_link_seconds(wire, cluster) if n > 1 or cluster.shards else 0.0
        shard = n * wire / (shards * speeds.shard_ingest_Bps * speeds.shard_cores)
        item = [("encode", encode / threads), ("push", link), ("shard", shard), ("result", link),
                ("decode", decode / threads)]
        if g > 1:  # the node's GPUs sum into one buffer before the push and share the result after it
            intra = 4 * numel * g / speeds.intranode_Bps
            item = [("reduce", intra), *item, ("broadcast", intra)]
        pushed += wire
        codec_cpu += encode + decode
        ready.append(t)
        stages.append(item)
    end, busy = pipeline_finish(ready, stages)
    if cluster.shards is None:
        nbytes = 2 * (n - 1) / n * pushed
    else:
        nbytes = max(pushed, n * pushed / cluster.shards)
    shard_cpu = n * pushed / shards / speeds.shard_ingest_Bps
    worker_net = 2 * nbytes if cluster.shards is None else 2 * pushed
    cpu = codec_cpu + worker_net / speeds.net_cpu_Bps + (shard_cpu if cluster.shards is None else 0.0)
    name = f"{bits}bit" if bits else "fp32"
    return _finish(f"cgx-{name}", name, workload, end, busy, link_s=nbytes / cluster.payload_Bps,
                   codec_s=busy.get("encode", 0.0) + busy.get("decode", 0.0), shard_cpu_s=shard_cpu, cpu_s=cpu,
                   nbytes=nbytes, shards=cluster.shards)


def predict(workload: Workload, cluster: Cluster, speeds: Speeds, option: str) -> Prediction:
    """One option's step: ``ddp-fp32``, ``ddp-fp16``, ``ddp-powersgd`` (rank 4), ``cgx-Nbit``, or ``cgx-fp32``
    (cgx-ps with compression off, every block fp32 through the shards: auto mode's uncompressed steps without a
    process group; not in ``OPTIONS``, which compares the ways to train)."""
    if option == "cgx-fp32":
        return _predict_cgx(workload, cluster, speeds, None)
    if option in ("ddp-fp32", "ddp-fp16"):
        return _predict_ddp(workload, cluster, speeds, option.removeprefix("ddp-"))
    if option == "ddp-powersgd":
        return _predict_powersgd(workload, cluster, speeds)
    bits = option.removeprefix("cgx-").removesuffix("bit")
    if option.startswith("cgx-") and option.endswith("bit") and bits.isdigit() and 1 <= int(bits) <= 8:
        return _predict_cgx(workload, cluster, speeds, int(bits))
    raise ValueError(f"unknown option {option!r}: use one of {', '.join(OPTIONS)}")


def predict_all(workload: Workload, cluster: Cluster, speeds: Speeds,
                options: Sequence[str] = OPTIONS) -> list[Prediction]:
    return [predict(workload, cluster, speeds, o) for o in options]


def shards_needed(workload: Workload, cluster: Cluster, speeds: Speeds, option: str = "cgx-4bit",
                  tolerance: float = 0.05) -> int:
    """The fewest dedicated shard hosts whose links and CPU are not the limit: the smallest S whose step is
    within ``tolerance`` of the step with S = n (where the nodes' own links bound it, BytePS's rule). Fewer
    than n suffice where backward hides the communication."""
    def step(s: int) -> float:
        return predict(workload, Cluster(cluster.nodes, cluster.link_bps, cluster.gpus_per_node, s,
                                         cluster.wire_efficiency, cluster.latency_s), speeds, option).step_s

    goal = step(cluster.nodes) * (1 + tolerance)
    lo, hi = 1, cluster.nodes  # more shards never slow a step: the first S within the goal, by bisection
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if step(mid) <= goal else (mid + 1, hi)
    return lo
