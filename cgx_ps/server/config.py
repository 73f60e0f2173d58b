"""Settings of one shard process."""

from __future__ import annotations

from dataclasses import dataclass

from ..transport import CHUNK_BYTES, GRPC_OPTIONS

__all__ = ["ServerConfig", "CHUNK_BYTES", "GRPC_OPTIONS"]


@dataclass
class ServerConfig:
    # where to listen
    host: str = "0.0.0.0"
    port: int = 7070  # 0 picks a free port (tests)
    metrics_port: int = -1  # Prometheus HTTP port; -1 disables, 0 picks a free one
    # which part of the model this shard owns
    shard_index: int = 0
    num_shards: int = 1
    # failure handling
    round_timeout_s: float = 60.0  # a round waiting longer for its last node fails for everyone
    drain_timeout_s: float = 20.0  # on SIGTERM, time to finish rounds in flight
    # memory: pushed bytes held but not yet summed; beyond it, reading pushes pauses
    max_inflight_bytes: int = 1 << 30
    # quality: carry each block's re-quantization error into its next round
    error_feedback: bool = False
    # threads running the codec kernels (0: one per CPU)
    kernel_threads: int = 0
    # memory: fp32 state a session's layout may make this shard hold (accumulators, residuals)
    max_model_bytes: int = 4 << 30
    # calls served at once; beyond it gRPC refuses new calls with RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int = 1024
    # security (docs/security.md): the job token, TLS and mutual TLS
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # a plaintext port serving only the gRPC health service (for kubelet probes when TLS is on)
    health_port: int = -1
    # where metrics listen; None: the same address as the gRPC port
    metrics_host: str | None = None

    @property
    def authenticates(self) -> bool:
        """Does every caller prove it belongs to the job (token or client certificate)?"""
        return bool(self.token_file or self.tls_client_ca)

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in 0..{self.num_shards - 1}, got {self.shard_index}")
        if self.round_timeout_s <= 0:
            raise ValueError(f"round_timeout_s must be > 0, got {self.round_timeout_s}")
        if self.max_inflight_bytes < 2 * CHUNK_BYTES:
            raise ValueError(f"max_inflight_bytes must be >= {2 * CHUNK_BYTES} (two chunks)")
        if self.max_model_bytes < 1:
            raise ValueError(f"max_model_bytes must be >= 1, got {self.max_model_bytes}")
        if self.max_concurrent_rpcs < 8:
            raise ValueError(f"max_concurrent_rpcs must be >= 8, got {self.max_concurrent_rpcs}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
