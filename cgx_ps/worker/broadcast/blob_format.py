"""Broadcast blobs that cannot execute code: a JSON structure plus a safetensors tensor payload.

``torch.save``/``torch.load(weights_only=False)`` is pickle: whoever can write a broadcast blob
could run code on every worker. This format only describes data, and the decoder treats its input
as hostile: no pickle, no eval, no imports, no attribute lookups on names taken from the data,
every length checked against what is really there, and every failure a ``BlobFormatError``.

Layout (integers little-endian)::

    magic      8 bytes    b"\\x89CGXBC\\r\\n"
    version    u32        FORMAT_VERSION
    n          u64        length of the structure (at most MAX_STRUCTURE_BYTES)
    structure  n bytes    UTF-8 JSON, described below
    m          u64        length of the payload
    payload    m bytes    a safetensors file holding the tensors, named "0", "1", ...

and nothing after the payload.

The structure is plain JSON for None, bool, str, lists, finite floats, ints that fit in 64 bits and
dicts whose keys are all str (a key starting with "$" is written with one more "$"). Everything
else is a one-key object whose key starts with a single "$" (a "marker"):

    {"$tensor": 3}               the payload's tensor "3"; each tensor is referenced exactly once
    {"$tuple": [...]}            a tuple
    {"$dict": [k0, v0, k1, ...]} a dict with keys other than str (ints in optimizer state), in order
    {"$int": "-0x1f..."}         an int outside 64 bits (hex: no quadratic decimal parsing)
    {"$float": "nan"}            "nan", "inf" or "-inf" (standard JSON has no such numbers)
    {"$bytes": "base64..."}      bytes
    {"$size": [2, 3]}            torch.Size
    {"$dtype": "float32"}        torch.dtype, from an allow-list
    {"$device": "cuda:1"}        torch.device, of an allow-listed type
"""

from __future__ import annotations
from __future__ import annotations

import struct
from typing import Any

import safetensors
import safetensors.torch
import torch

from .blob_tree import (MAX_CONTAINERS, MAX_DEPTH, MAX_STRUCTURE_BYTES, TENSOR_DTYPE_NAMES, corrupt, decode_tree,
                        encode_tree)
from ..errors import BlobFormatError

__all__ = ["BlobFormatError", "encode_object", "decode_object", "MAGIC", "FORMAT_VERSION", "MAX_CONTAINERS",
           "MAX_DEPTH", "MAX_STRUCTURE_BYTES"]

MAGIC = b"\x89CGXBC\r\n"  # non-ASCII first byte and CRLF catch text-mode mangling, like PNG's
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sI")
_LENGTH = struct.Struct("<Q")


def encode_object(obj: Any) -> bytes:
    """Serialize ``obj`` (see the module docstring for what it may hold). Tensors are copied to
    CPU. Raises BlobFormatError, naming the path of the first value that cannot be sent."""
    structure, tensors = encode_tree(obj)
    try:
        payload = safetensors.torch.save(tensors)
    except Exception as e:  # noqa: BLE001 - e.g. a dtype this safetensors version cannot store
        raise BlobFormatError(f"obj: cannot serialize its tensors: {e}") from e
    return b"".join((_PREFIX.pack(MAGIC, FORMAT_VERSION), _LENGTH.pack(len(structure)), structure,
                     _LENGTH.pack(len(payload)), payload))


def decode_object(data: bytes) -> Any:
    """Rebuild the object that ``encode_object`` serialized, with its tensors on CPU. Raises
    BlobFormatError for anything else, having run no code from the data."""
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise TypeError(f"decode_object takes bytes, not {type(data).__name__}")
    if data[:len(MAGIC)] != MAGIC:
        if len(data) < len(MAGIC) and MAGIC.startswith(data):
            raise corrupt(f"truncated to {len(data)} bytes")
        raise BlobFormatError("not a cgx-ps broadcast blob: was it written by an older cgx-ps or "
                              "by something else?")
    if len(data) < _PREFIX.size:
        raise corrupt(f"truncated to {len(data)} bytes")
    _, version = _PREFIX.unpack_from(data)
    if version != FORMAT_VERSION:
        raise BlobFormatError(f"broadcast blob format version {version}, but this cgx-ps reads "
                              f"version {FORMAT_VERSION}: do all ranks run the same cgx-ps?")
    structure, offset = _section(data, _PREFIX.size, "structure")
    payload, offset = _section(data, offset, "tensor payload")
    if offset != len(data):
        raise corrupt(f"{len(data) - offset} unexpected bytes after the payload")

    return decode_tree(structure, _load_tensors(payload))


def _section(data: bytes, offset: int, what: str) -> tuple[bytes, int]:
    """The u64-length-prefixed section at ``offset``, checked against the bytes really there
    (so a claimed 2**60 bytes is an error, not an allocation)."""
    if len(data) - offset < _LENGTH.size:
        raise corrupt(f"truncated before the {what} length")
    (length,) = _LENGTH.unpack_from(data, offset)
    offset += _LENGTH.size
    if length > len(data) - offset:
        raise corrupt(f"{what} length {length} exceeds the {len(data) - offset} bytes left")
    return data[offset:offset + length], offset + length


def _load_tensors(payload: bytes) -> dict[str, torch.Tensor]:
    try:
        # safetensors checks offsets, sizes and overlaps against the buffer, copies each
        # tensor's bytes into a writable bytearray, and makes CPU tensors over them
        tensors = safetensors.torch.load(payload)
    except Exception as e:  # noqa: BLE001 - SafetensorError, KeyError on a dtype, torch errors
        raise corrupt(f"tensor payload does not parse: {e}") from e
    except BaseException as e:  # pyo3 turns a Rust panic into PanicException, a BaseException
        if type(e).__name__ != "PanicException":
            raise
        raise corrupt(f"tensor payload does not parse: {e}") from None
    if set(tensors) != {str(i) for i in range(len(tensors))}:
        raise corrupt("tensor payload names are not 0, 1, ..., n-1")
    for name, t in tensors.items():
        if t.dtype not in TENSOR_DTYPE_NAMES:
            raise corrupt(f"tensor {name} has dtype {t.dtype}, not in the allow-list")
    return tensors
