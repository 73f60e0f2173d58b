"""How much memory a shard needs: the measured rule, as one function the docs, the manifests'
tests and operators use (benchmarks/shard_memory.py measures it; BENCHMARKS.md has the runs).

Measured on a real shard process (VmRSS; the runtime 2026-11-29, the rest 2026-11-23):
- 179 MiB idle (numba/LLVM 55, grpc, numpy, uvloop; a shard never imports torch), ~210 MiB
  after the first session loaded the numba kernels;
- owned fp32 model state F: +1.1 x F, peaking at 1.7 x F while a round is summed; server-side
  error feedback another +1.1 x F;
- pushes buffered up to --max-inflight-mb M: +1.1 x M;
- blobs (broadcasts), stored and still arriving, share one capacity equal to M: +1.0 x M;
- a call waiting for budget holds its first message: 1 MiB for an honest chunk, at most the
  8 MiB message limit for a hostile member, times --max-concurrent-rpcs.
"""

from __future__ import annotations

__all__ = ["BASE_MIB", "shard_memory_mib"]

BASE_MIB = 210.0  # runtime after the first session
_MODEL_PEAK = 1.7  # x F: accumulators plus the re-encode while a round is summed
_FEEDBACK = 1.1  # x F: server-side error-feedback residuals
_PUSHES = 1.1  # x M
_BLOBS = 1.0  # x M: the blob store's capacity is the in-flight cap
_HONEST_CHUNK_MIB = 1.0
_HOSTILE_CHUNK_MIB = 8.0
_SLACK = 1.1  # allocator fragmentation and Python objects the rule does not model


def shard_memory_mib(max_inflight_mb: float, max_model_mb: float, error_feedback: bool,
                     max_concurrent_rpcs: int, hostile_members: bool = False) -> float:
    """The memory limit (MiB) a shard needs at its caps: honest traffic, a member filling the
    blob store and the push budget, and every call slot holding a waiting first chunk
    (``hostile_members``: of the largest size gRPC admits)."""
    model = max_model_mb * (_MODEL_PEAK + (_FEEDBACK if error_feedback else 0.0))
    chunk = _HOSTILE_CHUNK_MIB if hostile_members else _HONEST_CHUNK_MIB
    need = BASE_MIB + model + (_PUSHES + _BLOBS) * max_inflight_mb + chunk * max_concurrent_rpcs
    return need * _SLACK
