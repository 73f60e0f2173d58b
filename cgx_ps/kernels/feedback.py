"""Encoding with error feedback, as workers (per block pushed) and shards (per aggregate) do it.

    feedback = ErrorFeedback()                      # one per buffer that is encoded every round
    payload = encode_block(buffer, Codec.MAXMIN, bits=4, bucket_size=1024, stochastic=True,
                           seed=seed, feedback=feedback).to_bytes()
    encode_with_feedback(tensor, residual, Codec.MAXMIN, ...)   # the same with a residual of one's own

Quantization drops part of every gradient; error feedback (EF-SGD) adds what the last encoding
of the same buffer dropped before encoding again, so the errors cancel over rounds instead of
adding up. Only max-min quantization gets it: the float codecs are (nearly) lossless, and a
buffer sent uncompressed for a round (warm-up, auto mode) keeps its residual for later.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .decoding import dequantize
from .encoding import EncodedBlock, PayloadScratch, encode, host_view, is_tensor, torch_module
from .wire import Codec

__all__ = ["ErrorFeedback", "encode_block", "encode_with_feedback"]


class ErrorFeedback:
    """What the lossy encodings of one buffer left out so far: zero until the first one."""

    def __init__(self) -> None:
        self.residual: Any = None  # of the encoded buffer's kind: a torch tensor, or a numpy array


def encode_block(tensor: Any, codec: Codec | int, *, bits: int, bucket_size: int, stochastic: bool,
                 seed: int, feedback: ErrorFeedback | None = None, allow_non_finite: bool = False,
                 scratch: PayloadScratch | None = None) -> EncodedBlock:
    """Encode ``tensor`` with ``codec``. With ``feedback`` and max-min quantization, encode
    ``tensor + feedback.residual`` instead (``tensor`` is updated in place: it holds that sum)
    and keep in the residual what this encoding left out. ``allow_non_finite``: a tensor with
    NaN/Inf becomes a non-finite block instead of an error (the residual is kept as it was).
    ``scratch``: the payload's reused memory (``PayloadScratch``)."""
    if feedback is None or int(codec) != Codec.MAXMIN:
        return encode(tensor, codec, bits=bits, bucket_size=bucket_size, stochastic=stochastic, seed=seed,
                      allow_non_finite=allow_non_finite, scratch=scratch)
    if feedback.residual is None:
        feedback.residual = torch_module().zeros_like(tensor) if is_tensor(tensor) else np.zeros_like(tensor)
    return encode_with_feedback(tensor, feedback.residual, codec, bits=bits, bucket_size=bucket_size,
                                stochastic=stochastic, seed=seed, allow_non_finite=allow_non_finite,
                                scratch=scratch)


def encode_with_feedback(tensor: Any, residual: Any, codec: Codec | int, *, bits: int,
                         bucket_size: int, stochastic: bool, seed: int,
                         allow_non_finite: bool = False, scratch: PayloadScratch | None = None) -> EncodedBlock:
    """Error feedback: encode ``tensor + residual`` and leave in ``residual`` what the encoding
    left out, to be added next time. ``tensor`` is updated in place (it holds the sum). A
    non-finite block (``allow_non_finite``) leaves the residual as it was: that step's gradient
    is thrown away by every rank (a loss scaler skips it), its error with it."""
    tensors = is_tensor(tensor)  # a worker's; a shard's are numpy arrays (the same float32 arithmetic)
    if tensors:
        tensor.add_(residual)
    else:
        residual = host_view(residual)
        np.add(tensor, residual, out=tensor)
    encoded = encode(tensor, codec, bits=bits, bucket_size=bucket_size, stochastic=stochastic, seed=seed,
                     allow_non_finite=allow_non_finite, scratch=scratch)
    if encoded.header.non_finite:
        return encoded
    dequantize(encoded, out=residual)
    if tensors:
        residual.neg_().add_(tensor)
    else:
        np.add(np.negative(residual, out=residual), tensor, out=residual)
    return encoded
