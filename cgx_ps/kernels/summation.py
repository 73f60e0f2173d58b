"""Summing encoded blocks as a shard sums a round's pushes: keep the bodies, sum once, encode once.

    total = EncodedSum(numel, parts=num_nodes)
    for payload in pushes:                  # in arrival order
        total.add(payload)                  # validated (CodecError), kept: nothing decoded yet
    block = total.encode(Codec.MAXMIN, bits=4, bucket_size=1024, stochastic=True, seed=s, feedback=fb)
    total.clear()                           # the next round reuses the buffers

Decoding each push into an fp32 accumulator reads and writes the whole accumulator once per push:
for a 4 MB block of 4-bit pushes, 8 MB of memory traffic per 0.5 MB pushed, and a kernel call
(with its thread hand-offs) per push. Here max-min pushes are kept as they arrive, and one fused
kernel per round sums each bucket from all of them in a scratch buffer that stays in L1 and
encodes it right away (``cpu.sum_maxmin_into``): no accumulator at all. The additions are the
same, in the same order, so the bytes equal the accumulator path's (tests/test_summation.py).
Float codecs (FP32, FP16, BF16) are decoded into an fp32 accumulator as they come.

Kept where it is: a push's (min, unit) pairs are copied into a row of ``_metas`` (8 bytes per
bucket, aligned for the kernel), and its packed levels are read where they arrived, once the
whole payload has been checked. Copying them into slots of their own cost the shard 6.6 ms per
round on its event loop (4 nodes x 24 blocks of 0.53 MB on an AVX2 host, ``benchmarks/aggregator.py``).
Only an immutable payload (``bytes``, or a read-only view of one: what gRPC hands the shard) is
kept by reference, since nothing can change it after its crc32 was checked; a mutable one (a
``bytearray``) has its levels copied.

Memory: a sum holds either its kept pushes or its accumulator, not both (``held_bytes``), so a
shard needs what the accumulator path needed (server/process/sizing.py). Pushes are kept only when one
body from each of ``parts`` nodes fits in ``keep_bytes`` (default: the accumulator's size, 4 x
numel: up to 7 nodes at 4 bits, 15 at 2 bits); more nodes sum through the accumulator. Switching
between the two (a warm-up's FP32 rounds, then 4-bit ones) frees the one no longer used. More
pushes than ``parts``, or a change of encoding within one sum (a shard refuses both), are folded
into the accumulator by the same kernel, storing instead of encoding; only then are both held,
until the sum is cleared.
"""

from __future__ import annotations

import numpy as np

from . import cpu
from .decoding import check_payload, dequantize
from .encoding import BytesLike, EncodedBlock, PayloadScratch, host_view, non_finite_block
from .errors import CodecError
from .feedback import ErrorFeedback, encode_block
from .wire import FLAG_STOCHASTIC, HEADER_SIZE, Codec, Header, pack_header, split_maxmin_body

__all__ = ["EncodedSum"]


class EncodedSum:
    """The sum of encoded blocks of ``numel`` elements, added one at a time (not thread-safe: one
    caller at a time, as a shard's block lock ensures)."""

    def __init__(self, numel: int, parts: int = 1, keep_bytes: int | None = None, threads: int | None = None
                 ) -> None:
        if numel < 0 or parts < 1:
            raise ValueError(f"numel must be >= 0 and parts >= 1, got {numel} and {parts}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 (or None: the kernels' default), got {threads}")
        self.numel = numel
        self.parts = parts  # blocks expected per sum: sizes the metadata rows and the keep rule
        self.keep_bytes = 4 * numel if keep_bytes is None else keep_bytes
        # threads one summing kernel call splits its buckets over (None: cpu.num_threads()); a
        # caller that already sums several blocks at once on its own threads passes 1
        self.threads = threads
        self.count = 0  # blocks added since the last clear
        self.non_finite = False  # one of them was a non-finite block: the sum is NaN
        # kept max-min pushes: (min, unit) pairs one per row (rows kept between sums), packed levels
        # as views of the payloads (module doc), in arrival order
        self._metas: np.ndarray | None = None
        self._levels: list[np.ndarray] = []
        self._levels_hold = 0  # bytes those views keep alive: whole payloads, or the copies
        self._kept_format: tuple[int, int] | None = None  # (bits, bucket_size) of those pushes
        self._acc: np.ndarray | None = None  # fp32 sum of what was folded or decoded so far
        self._acc_holds_sum = False

    def add(self, payload: BytesLike) -> Header:
        """Add a wire payload (fully validated first: a bad one raises CodecError and changes
        nothing); its header."""
        header = check_payload(payload)
        if header.numel != self.numel:
            raise CodecError(f"block holds {header.numel} elements, the sum {self.numel}")
        self.count += 1
        if header.non_finite:  # NaN + anything is NaN: nothing left to add
            self.non_finite = True
            return header
        if header.codec != Codec.MAXMIN or not self._fits(header):
            self._fold()  # what was kept comes first: the additions stay in arrival order
            if self._metas is not None and not self._levels:
                self._metas = None  # the accumulator replaces them (module doc: one or the other)
            acc = self._accumulator()
            dequantize(EncodedBlock(header, _as_array(payload)), out=acc, accumulate=self._acc_holds_sum)
            self._acc_holds_sum = True
            return header
        fmt = (header.bits, header.bucket_size)
        if self._levels and (len(self._levels) == self.parts or fmt != self._kept_format):
            self._fold()
        meta, levels = split_maxmin_body(np.frombuffer(payload, dtype=np.uint8, offset=HEADER_SIZE), self.numel,
                                         header.bucket_size)
        self._metas_for(meta.size)[len(self._levels)] = meta
        if memoryview(payload).readonly:
            self._levels.append(levels)
            self._levels_hold += len(payload)
        else:  # a buffer its owner could still change: the levels as they were checked
            self._levels.append(levels.copy())
            self._levels_hold += levels.nbytes
        self._kept_format = fmt
        return header

    def add_scaled(self, payload: BytesLike, scale: float) -> Header:
        """Add ``scale`` times a wire payload (validated first, as ``add``): a shard's correction
        for a late push (server/rounds/late_rounds.py). It goes into the accumulator, onto which
        an encode then adds the kept pushes, so it needs no fold; added to a sum already there, it
        costs one temporary block of fp32 while it is decoded."""
        header = check_payload(payload)
        if header.numel != self.numel:
            raise CodecError(f"block holds {header.numel} elements, the sum {self.numel}")
        self.count += 1
        if header.non_finite:
            self.non_finite = True
            return header
        block, acc = EncodedBlock(header, _as_array(payload)), self._accumulator()
        if self._acc_holds_sum:  # the decode scales in its own pass (dequantize's scale=), then one addition
            acc += dequantize(block, out=np.empty(self.numel, dtype=np.float32), scale=scale)
        else:
            dequantize(block, out=acc, scale=scale)
        self._acc_holds_sum = True
        return header

    def keeps(self, header: Header) -> bool:
        """Would ``add`` of a valid payload with this header only check and keep it, or note a
        non-finite block: no decoding and no fold of kept pushes? (A shard keeps such a push
        without a hop to a kernel thread.)"""
        if header.non_finite:
            return True
        if header.codec != Codec.MAXMIN or header.numel != self.numel or not self._fits(header):
            return False  # the accumulator path: add decodes
        return not self._levels or (len(self._levels) < self.parts
                                    and self._kept_format == (header.bits, header.bucket_size))

    def encode(self, codec: Codec | int, *, bits: int, bucket_size: int, stochastic: bool, seed: int,
               feedback: ErrorFeedback | None = None, allow_non_finite: bool = False,
               scratch: PayloadScratch | None = None) -> EncodedBlock:
        """The sum, encoded as ``encode_block`` would encode the accumulated sum (CodecError as
        it raises them; after one, the residual of ``feedback`` is unspecified). ``scratch``:
        the payload's reused memory (``PayloadScratch``: the block is valid until the next
        encode into it)."""
        if self.count == 0:
            raise CodecError("nothing to encode: no block was added to the sum")
        if self.non_finite:
            if not allow_non_finite:
                raise CodecError("the sum is not finite: a non-finite block was added")
            return non_finite_block(codec, bits, bucket_size, self.numel)
        fused = (int(codec) == Codec.MAXMIN and self._levels and self._kept_format == (bits, bucket_size)
                 # a non-finite result must leave the residual untouched: the accumulator path does
                 and not (allow_non_finite and feedback is not None))
        if fused:
            return self._encode_fused(bits, bucket_size, stochastic, seed, feedback, allow_non_finite, scratch)
        self._fold()
        return encode_block(self._accumulator(), codec, bits=bits, bucket_size=bucket_size, stochastic=stochastic,
                            seed=seed, feedback=feedback, allow_non_finite=allow_non_finite, scratch=scratch)

    def clear(self) -> None:
        """Start a new sum (the buffers are kept for it, after a fold only the metadata rows; the
        pushes are let go)."""
        if self._metas is not None and self._acc is not None:
            self._acc = None
        self._levels, self._levels_hold = [], 0
        self.count, self.non_finite, self._kept_format, self._acc_holds_sum = 0, False, None, False

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers this sum holds (kept pushes, their metadata rows, the accumulator)."""
        return (0 if self._metas is None else self._metas.nbytes) + self._levels_hold + \
            (0 if self._acc is None else self._acc.nbytes)

    # ---- internals --------------------------------------------------------------------------------

    def _fits(self, header: Header) -> bool:
        """Do one push of this size from each of ``parts`` nodes fit in ``keep_bytes``? (Else
        the accumulator path.)"""
        return self.parts * (HEADER_SIZE + header.body_size) <= self.keep_bytes

    def _metas_for(self, columns: int) -> np.ndarray:
        """One metadata row per part of ``columns`` float32 (allocated once, reused)."""
        if self._metas is None or self._metas.shape != (self.parts, columns):
            self._fold()  # pushes of another bucket size may be kept: sum them before their rows go
            self._metas = np.empty((self.parts, columns), dtype=np.float32)
            if not self._acc_holds_sum:
                self._acc = None  # the kept pushes replace it (module doc: one or the other)
        return self._metas

    def _accumulator(self) -> np.ndarray:
        if self._acc is None:
            self._acc = np.empty(self.numel, dtype=np.float32)
        return self._acc

    def _fold(self) -> None:
        """Add the kept pushes into the accumulator and let them go."""
        if not self._levels:
            return
        bits, bucket = self._kept_format
        cpu.sum_maxmin_into(self._levels, self._metas, self.numel, bits, bucket, self._accumulator(),
                            self._acc_holds_sum, None, None, False, 0, self.threads)
        self._acc_holds_sum, self._levels, self._levels_hold = True, [], 0

    def _encode_fused(self, bits: int, bucket_size: int, stochastic: bool, seed: int,
                      feedback: ErrorFeedback | None, allow_non_finite: bool,
                      scratch: PayloadScratch | None) -> EncodedBlock:
        header = Header(Codec.MAXMIN, bits, FLAG_STOCHASTIC if stochastic else 0, self.numel, bucket_size, 0)
        payload = np.zeros(HEADER_SIZE + header.body_size, dtype=np.uint8) if scratch is None \
            else scratch.payload(header)
        meta, packed = split_maxmin_body(payload[HEADER_SIZE:], self.numel, bucket_size)
        residual = None
        if feedback is not None:
            if feedback.residual is None:
                feedback.residual = np.zeros(self.numel, dtype=np.float32)
            residual = host_view(feedback.residual)
        bad, overflow = cpu.sum_maxmin_into(self._levels, self._metas, self.numel, bits, bucket_size,
                                            self._acc if self._acc_holds_sum else None,
                                            self._acc_holds_sum, (meta, packed), residual, stochastic, seed,
                                            self.threads)
        if bad >= 0 or overflow >= 0:
            if allow_non_finite:
                return non_finite_block(Codec.MAXMIN, bits, bucket_size, self.numel)
            if bad >= 0:
                raise CodecError(f"the sum contains NaN/Inf (in bucket {bad})")
            raise CodecError(f"bucket {overflow}: max - min of the sum overflows float32; gradient out of range")
        payload[:HEADER_SIZE] = np.frombuffer(pack_header(header), dtype=np.uint8)
        return EncodedBlock(header, payload)


def _as_array(payload: BytesLike) -> np.ndarray:
    """A payload as the uint8 array an EncodedBlock holds (a view, no copy)."""
    return np.frombuffer(payload, dtype=np.uint8)
