"""Prometheus metrics of one shard (a registry per server, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["PLANES", "ShardMetrics"]

# How an Exchange stream reaches the shard: its gRPC port, or the raw data plane (--data-port)
PLANES = ("grpc", "raw")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ShardMetrics:
    def __init__(self, shard_index: int) -> None:
        self.registry = CollectorRegistry()
        labels = {"shard": str(shard_index)}
        r = self.registry
        self.bytes_in = Counter("cgx_ps_bytes_in", "Compressed block bytes received (payloads)",
                                ["shard"], registry=r).labels(**labels)
        self.bytes_out = Counter("cgx_ps_bytes_out", "Aggregated block bytes sent, all nodes",
                                 ["shard"], registry=r).labels(**labels)
        self.pushes = Counter("cgx_ps_pushes", "Block pushes by node and outcome (accepted, duplicate, rejected; "
                              "late: after a quorum round closed without it, carried into a later one)",
                              ["shard", "node", "outcome"], registry=r)
        self.rounds = Counter("cgx_ps_rounds", "Block rounds aggregated", ["shard"],
                              registry=r).labels(**labels)
        self.rounds_failed = Counter("cgx_ps_rounds_failed", "Rounds failed (a node missed the deadline)",
                                     ["shard"], registry=r).labels(**labels)
        self.round_latency = Histogram("cgx_ps_round_latency_seconds",
                                       "First push of a block round to its result being queued",
                                       ["shard"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.last_node_wait = Histogram("cgx_ps_last_node_wait_seconds",
                                        "Time a block round waited for its last node after the first",
                                        ["shard"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.compression_ratio = Gauge("cgx_ps_compression_ratio",
                                       "fp32 bytes / pushed bytes of the last aggregated block",
                                       ["shard"], registry=r).labels(**labels)
        self.connected_nodes = Gauge("cgx_ps_connected_nodes", "Nodes with an open Exchange stream",
                                     ["shard"], registry=r).labels(**labels)
        # Both planes' series exist from the start: an operator reads "0 raw streams" as the workers
        # not using the plane (a NetworkPolicy without the data port, CGX_PS_DATAPLANE=grpc, TLS),
        # where a missing series would read as no data.
        streams = Gauge("cgx_ps_exchange_streams", "Exchange streams open, by plane (grpc: the gRPC port, raw: "
                        "the raw data plane)", ["shard", "plane"], registry=r)
        self.exchange_streams = {plane: streams.labels(plane=plane, **labels) for plane in PLANES}
        self.inflight_bytes = Gauge("cgx_ps_inflight_bytes", "Pushed bytes buffered, not yet summed",
                                    ["shard"], registry=r).labels(**labels)
        self.block_bits = Gauge("cgx_ps_block_bits", "Bits per element a block travels with since the last "
                                "SetCodecs (32: uncompressed)", ["shard", "block"], registry=r)
        self._shard = str(shard_index)
        # labels() builds and checks its key and takes a lock on every call; a push is counted per
        # message on the event loop, so each (node, outcome) child is looked up once. Bounded as the
        # metric's own children are: one per node id that pushed, and four outcomes.
        self._push_counters: dict[tuple[str, str], Counter] = {}

    @property
    def shard(self) -> str:
        return self._shard

    def push(self, node: str, outcome: str) -> None:
        counter = self._push_counters.get((node, outcome))
        if counter is None:
            counter = self._push_counters[(node, outcome)] = self.pushes.labels(shard=self._shard, node=node,
                                                                                outcome=outcome)
        counter.inc()
