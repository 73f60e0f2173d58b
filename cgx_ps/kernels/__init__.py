"""cgx_ps.kernels — gradient codecs of one versioned wire format (docs/wire-format.md).

    block = quantize(grad, bits=4, bucket_size=1024, stochastic=True, seed=step)
    payload = block.to_bytes()                       # what travels
    dequantize(payload, out=acc, accumulate=True)    # decode into a sum
    total = EncodedSum(numel, parts=nodes)           # what a shard does: keep, sum once,
    total.add(payload); total.encode(...)            # re-encode once (summation.py)

Implementations: plain-torch reference (``reference``), fused multithreaded CPU kernels (``cpu``,
numba) and CuPy kernels for CUDA tensors (``cuda``); the input's device picks one. Inputs are torch
tensors or numpy arrays: a shard sums numpy arrays and never imports torch (``encoding``). Modules:
``encoding`` and ``decoding`` (one tensor to and from the wire format, ``wire``), ``feedback``
(encoding with error feedback), ``summation`` (a shard's sum of pushes). This package imports
nothing else of cgx_ps, so it can be reused on its own.
"""

from .decoding import check_payload, decode_header, dequantize
from .encoding import EncodedBlock, Impl, PayloadScratch, encode, non_finite_block, quantize
from .errors import CodecError
from .feedback import ErrorFeedback, encode_block, encode_with_feedback
from .summation import EncodedSum
from .wire import HEADER_SIZE, WIRE_VERSION, Codec, Header, body_size, contributors_of, set_contributors

__all__ = [
    "Codec",
    "CodecError",
    "EncodedBlock",
    "EncodedSum",
    "ErrorFeedback",
    "HEADER_SIZE",
    "Header",
    "Impl",
    "PayloadScratch",
    "WIRE_VERSION",
    "body_size",
    "contributors_of",
    "set_contributors",
    "check_payload",
    "decode_header",
    "dequantize",
    "encode",
    "encode_block",
    "encode_with_feedback",
    "non_finite_block",
    "quantize",
]
