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

import base64
import binascii
import json
import math
import re
import struct
from typing import Any, NoReturn

import safetensors
import safetensors.torch
import torch

from .errors import CgxPsError

__all__ = ["BlobFormatError", "encode_object", "decode_object"]

MAGIC = b"\x89CGXBC\r\n"  # non-ASCII first byte and CRLF catch text-mode mangling, like PNG's
FORMAT_VERSION = 1
# Limits, shared by the encoder (so that whatever encodes also decodes) and the decoder:
MAX_DEPTH = 64  # nested lists/tuples/dicts; state dicts need ~4, deeper is a bug or an attack
# The structure holds names and small values, not bulk data (that goes in tensors): 16 MiB is
# Adam's state for ~150k parameter tensors. Bounding it, and the number of containers in it,
# bounds what decoding allocates (an empty list costs ~40x its 2-3 bytes of JSON, so the worst
# structure peaks at ~250 MB of Python objects).
MAX_STRUCTURE_BYTES = 16 << 20
MAX_CONTAINERS = 1 << 20

_PREFIX = struct.Struct("<8sI")
_LENGTH = struct.Struct("<Q")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_DEVICE = re.compile(r"([a-z]+)(?::(0|[1-9][0-9]{0,5}))?")
_DEVICE_TYPES = frozenset({"cpu", "cuda", "mps", "xpu", "hpu", "meta"})


def _dtypes(names: tuple[str, ...]) -> dict[str, torch.dtype]:
    # getattr on OUR names only, never on the data's; names this torch lacks are skipped
    return {n: getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}


# Tensor dtypes the safetensors payload may hold (what safetensors.torch can store).
_TENSOR_DTYPES = _dtypes((
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "uint16", "uint32", "uint64", "bool", "complex64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz"))
# torch.dtype values (not tensors) may name a few more.
_DTYPE_VALUES = {**_TENSOR_DTYPES, **_dtypes(("complex128", "complex32"))}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPE_VALUES.items()}
_SUPPORTED = ("None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor, torch.Size, "
              "torch.dtype or torch.device")


class BlobFormatError(CgxPsError):
    """A value cannot be broadcast, or a received broadcast blob is corrupt or not one at all."""


# Paths are built lazily as (parent, step) links and only formatted for an error message.
_Path = tuple[Any, Any] | None


def _format_path(path: _Path) -> str:
    steps: list[str] = []
    while path is not None:
        path, step = path
        text = repr(step)
        steps.append(text if len(text) <= 60 else text[:57] + "...")  # hostile keys can be huge
    return "obj" + "".join(f"[{s}]" for s in reversed(steps))


# ---------------------------------------------------------------- encoding


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.containers = 0

    def fail(self, path: _Path, what: str) -> NoReturn:
        raise BlobFormatError(f"{_format_path(path)}: {what}")

    def enter(self, path: _Path, depth: int) -> None:
        if depth >= MAX_DEPTH:
            self.fail(path, f"nested deeper than {MAX_DEPTH} levels (a cycle?)")
        # also stops a DAG that shares subtrees from expanding exponentially
        self.containers += 1
        if self.containers > MAX_CONTAINERS:
            self.fail(path, f"more than {MAX_CONTAINERS} lists/tuples/dicts: "
                            "put bulk data in tensors")

    def scalar(self, obj: Any) -> Any:
        """The encoding of a None/bool/int/float/str (subclasses such as IntEnum or numpy.float64
        are sent as the base type), or NotImplemented."""
        if obj is None or obj is True or obj is False:
            return obj
        if isinstance(obj, int):
            obj = int(obj)
            return obj if _INT64_MIN <= obj <= _INT64_MAX else {"$int": hex(obj)}
        if isinstance(obj, float):
            obj = float(obj)
            return obj if math.isfinite(obj) else {"$float": repr(obj)}  # 'nan', 'inf', '-inf'
        if isinstance(obj, str):
            return str.__str__(obj)
        return NotImplemented

    def key(self, obj: Any, path: _Path, depth: int) -> Any:
        encoded = self.scalar(obj)
        if encoded is not NotImplemented:
            return encoded
        if type(obj) is tuple:
            self.enter(path, depth)
            return {"$tuple": [self.key(k, (path, i), depth + 1) for i, k in enumerate(obj)]}
        self.fail(path, f"cannot broadcast {_type_name(obj)} as a dict key "
                        "(keys must be None, bool, int, float, str or tuples of them)")

    def value(self, obj: Any, path: _Path, depth: int) -> Any:
        encoded = self.scalar(obj)
        if encoded is not NotImplemented:
            return encoded
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, torch.Size):  # before tuple: Size is a tuple subclass
            return {"$size": [int(n) for n in obj]}
        if isinstance(obj, torch.dtype):
            if obj not in _DTYPE_NAMES:
                self.fail(path, f"cannot broadcast the dtype {obj}")
            return {"$dtype": _DTYPE_NAMES[obj]}
        if isinstance(obj, torch.device):
            if obj.type not in _DEVICE_TYPES:
                self.fail(path, f"cannot broadcast a device of type {obj.type!r}")
            return {"$device": str(obj)}
        if type(obj) is bytes:
            return {"$bytes": base64.b64encode(obj).decode("ascii")}
        if type(obj) is list:
            self.enter(path, depth)
            return [self.value(v, (path, i), depth + 1) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            self.enter(path, depth)
            return {"$tuple": [self.value(v, (path, i), depth + 1) for i, v in enumerate(obj)]}
        if isinstance(obj, dict):  # OrderedDict, defaultdict... arrive as dicts, order kept
            self.enter(path, depth)
            if all(type(k) is str for k in obj):
                # "$" starts markers, so a user key starting with "$" gets one more
                return {("$" + k if k.startswith("$") else k): self.value(v, (path, k), depth + 1)
                        for k, v in obj.items()}
            flat: list[Any] = []  # k0, v0, k1, v1...: fewer brackets than [k, v] pairs
            for k, v in obj.items():
                flat += (self.key(k, (path, k), depth + 1), self.value(v, (path, k), depth + 1))
            return {"$dict": flat}
        hint = ""
        if isinstance(obj, (list, tuple)):  # namedtuples etc. would silently lose their type
            hint = f": convert it to a plain {'list' if isinstance(obj, list) else 'tuple'}"
        elif isinstance(obj, (bytearray, memoryview)):
            hint = ": convert it to bytes"
        self.fail(path, f"cannot broadcast {_type_name(obj)}{hint} (supported: {_SUPPORTED})")

    def tensor(self, t: torch.Tensor, path: _Path) -> dict[str, int]:
        if t.layout != torch.strided or t.is_nested:
            self.fail(path, f"cannot broadcast a tensor of layout {t.layout}: make it dense")
        if t.is_quantized or t.device.type == "meta":
            kind = "quantized" if t.is_quantized else "meta"
            self.fail(path, f"cannot broadcast a {kind} tensor")
        if t.dtype not in _DTYPE_NAMES or _DTYPE_NAMES[t.dtype] not in _TENSOR_DTYPES:
            self.fail(path, f"cannot broadcast a tensor of dtype {t.dtype}")
        # A fresh contiguous CPU copy per occurrence: safetensors refuses views and tensors that
        # share storage (tied weights, slices), and the copy also resolves conj/neg bits.
        with torch.no_grad():
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            copy.copy_(t.detach())
        index = len(self.tensors)
        self.tensors[str(index)] = copy
        return {"$tensor": index}


def _type_name(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__code__"):
        return "a function"
    cls = type(obj)
    name = cls.__qualname__
    if cls.__module__ != "builtins":
        name = f"{cls.__module__}.{name}"
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def encode_object(obj: Any) -> bytes:
    """Serialize ``obj`` (see the module docstring for what it may hold). Tensors are copied to
    CPU. Raises BlobFormatError, naming the path of the first value that cannot be sent."""
    encoder = _Encoder()
    tree = encoder.value(obj, None, 0)
    # allow_nan=False: the encoder already turned every non-finite float into a marker
    structure = json.dumps(tree, ensure_ascii=True, allow_nan=False, check_circular=False,
                           separators=(",", ":")).encode("ascii")
    if len(structure) > MAX_STRUCTURE_BYTES or _containers(structure) > MAX_CONTAINERS:
        raise BlobFormatError(
            f"obj: its structure takes {len(structure)} bytes and {_containers(structure)} "
            f"brackets of JSON, over the limits receivers accept ({MAX_STRUCTURE_BYTES}, "
            f"{MAX_CONTAINERS}): put bulk data in tensors")
    try:
        payload = safetensors.torch.save(encoder.tensors)
    except Exception as e:  # noqa: BLE001 - e.g. a dtype this safetensors version cannot store
        raise BlobFormatError(f"obj: cannot serialize its tensors: {e}") from e
    return b"".join((_PREFIX.pack(MAGIC, FORMAT_VERSION), _LENGTH.pack(len(structure)), structure,
                     _LENGTH.pack(len(payload)), payload))


def _containers(structure: bytes) -> int:
    # counts brackets inside strings too: an upper bound, which is all a limit needs
    return structure.count(b"[") + structure.count(b"{")


# ---------------------------------------------------------------- decoding


def _corrupt(what: str) -> BlobFormatError:
    return BlobFormatError(f"corrupt broadcast blob: {what}")


def _reject_constant(name: str) -> NoReturn:
    raise _corrupt(f"non-standard JSON constant {name}")  # NaN/Infinity: we never write them


def _parse_int(text: str) -> int:
    # we only write 64-bit ints as JSON numbers; refusing long ones keeps decimal parsing linear
    if len(text) > 20:
        raise _corrupt("integer literal too long")
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _corrupt("duplicate key in a JSON object")
    return result


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.used: set[int] = set()

    def fail(self, path: _Path, what: str) -> NoReturn:
        raise _corrupt(f"at {_format_path(path)}: {what}")

    def enter(self, path: _Path, depth: int) -> None:
        if depth >= MAX_DEPTH:
            self.fail(path, f"nested deeper than {MAX_DEPTH} levels")

    @staticmethod
    def marker(node: dict[str, Any]) -> str | None:
        """The marker name of a JSON object, or None for a plain dict."""
        for k in node:
            if k.startswith("$") and not k.startswith("$$"):
                return k if len(node) == 1 else ""
        return None

    def scalar_marker(self, name: str, arg: Any, path: _Path) -> Any:
        if name == "$int" and type(arg) is str and _HEX_INT.fullmatch(arg):
            return int(arg, 16)  # linear in the length, unlike decimal
        if name == "$float" and arg in ("nan", "inf", "-inf"):
            return float(arg)
        self.fail(path, f"bad {name} marker")

    def key(self, node: Any, path: _Path, depth: int) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is dict:
            name = self.marker(node)
            if name == "$tuple" and type(node[name]) is list:
                self.enter(path, depth)
                return tuple(self.key(k, (path, i), depth + 1) for i, k in enumerate(node[name]))
            if name in ("$int", "$float"):
                return self.scalar_marker(name, node[name], path)
        self.fail(path, "a dict key must be None, bool, int, float, str or a tuple of them")

    def value(self, node: Any, path: _Path, depth: int) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is list:
            self.enter(path, depth)
            return [self.value(v, (path, i), depth + 1) for i, v in enumerate(node)]
        name = self.marker(node)  # json.loads only makes None/bool/int/float/str/list/dict
        if name is None:
            self.enter(path, depth)
            return {(k[1:] if k.startswith("$") else k): self.value(v, (path, k), depth + 1)
                    for k, v in node.items()}
        if name == "":
            self.fail(path, "a marker must be the only key of its object")
        arg = node[name]
        if name == "$tensor":
            return self.tensor(arg, path)
        if name == "$tuple" and type(arg) is list:
            self.enter(path, depth)
            return tuple(self.value(v, (path, i), depth + 1) for i, v in enumerate(arg))
        if name == "$dict" and type(arg) is list and len(arg) % 2 == 0:
            self.enter(path, depth)
            result: dict[Any, Any] = {}
            for i in range(0, len(arg), 2):
                k = self.key(arg[i], path, depth + 1)
                if k in result:
                    self.fail(path, f"duplicate key {str(k)[:40]}")
                result[k] = self.value(arg[i + 1], (path, k), depth + 1)
            return result
        if name == "$bytes" and type(arg) is str:
            try:
                return base64.b64decode(arg.encode("ascii"), validate=True)
            except (ValueError, binascii.Error):  # non-ASCII, bad alphabet or padding
                self.fail(path, "bad base64 in $bytes")
        if name == "$size" and type(arg) is list and all(
                type(n) is int and 0 <= n <= _INT64_MAX for n in arg):
            return torch.Size(arg)
        if name == "$dtype" and type(arg) is str and arg in _DTYPE_VALUES:
            return _DTYPE_VALUES[arg]
        if name == "$device" and type(arg) is str:
            match = _DEVICE.fullmatch(arg)
            if match and match[1] in _DEVICE_TYPES:
                return torch.device(match[1], int(match[2])) if match[2] else torch.device(match[1])
            self.fail(path, f"bad device {arg[:40]!r}")
        if name in ("$int", "$float"):
            return self.scalar_marker(name, arg, path)
        self.fail(path, f"unknown marker {name[:40]!r} or bad argument")

    def tensor(self, index: Any, path: _Path) -> torch.Tensor:
        if type(index) is not int or str(index) not in self.tensors:
            self.fail(path, f"reference to a tensor {str(index)[:40]} that the payload lacks")
        if index in self.used:
            self.fail(path, f"tensor {index} referenced twice")
        self.used.add(index)
        return self.tensors[str(index)]


def decode_object(data: bytes) -> Any:
    """Rebuild the object that ``encode_object`` serialized, with its tensors on CPU. Raises
    BlobFormatError for anything else, having run no code from the data."""
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise TypeError(f"decode_object takes bytes, not {type(data).__name__}")
    if data[:len(MAGIC)] != MAGIC:
        if len(data) < len(MAGIC) and MAGIC.startswith(data):
            raise _corrupt(f"truncated to {len(data)} bytes")
        raise BlobFormatError("not a cgx-ps broadcast blob: was it written by an older cgx-ps or "
                              "by something else?")
    if len(data) < _PREFIX.size:
        raise _corrupt(f"truncated to {len(data)} bytes")
    _, version = _PREFIX.unpack_from(data)
    if version != FORMAT_VERSION:
        raise BlobFormatError(f"broadcast blob format version {version}, but this cgx-ps reads "
                              f"version {FORMAT_VERSION}: do all ranks run the same cgx-ps?")
    structure, offset = _section(data, _PREFIX.size, "structure")
    payload, offset = _section(data, offset, "tensor payload")
    if offset != len(data):
        raise _corrupt(f"{len(data) - offset} unexpected bytes after the payload")

    if len(structure) > MAX_STRUCTURE_BYTES or _containers(structure) > MAX_CONTAINERS:
        raise _corrupt(f"structure of {len(structure)} bytes is over this cgx-ps's limits")
    try:
        tree = json.loads(str(structure, "utf-8"), object_pairs_hook=_object,
                          parse_constant=_reject_constant, parse_int=_parse_int)
    except RecursionError:  # json's parser recurses per nesting level
        raise _corrupt(f"structure nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _corrupt(f"structure is not valid JSON: {e}") from None

    tensors = _load_tensors(payload)
    decoder = _Decoder(tensors)
    try:
        obj = decoder.value(tree, None, 0)
    except RecursionError:  # cannot happen within MAX_DEPTH; here so no other type escapes
        raise _corrupt("structure nested too deeply") from None
    if len(decoder.used) != len(tensors):
        raise _corrupt(f"{len(tensors) - len(decoder.used)} tensors in the payload are never used")
    return obj


def _section(data: bytes, offset: int, what: str) -> tuple[bytes, int]:
    """The u64-length-prefixed section at ``offset``, checked against the bytes really there
    (so a claimed 2**60 bytes is an error, not an allocation)."""
    if len(data) - offset < _LENGTH.size:
        raise _corrupt(f"truncated before the {what} length")
    (length,) = _LENGTH.unpack_from(data, offset)
    offset += _LENGTH.size
    if length > len(data) - offset:
        raise _corrupt(f"{what} length {length} exceeds the {len(data) - offset} bytes left")
    return data[offset:offset + length], offset + length


def _load_tensors(payload: bytes) -> dict[str, torch.Tensor]:
    try:
        # safetensors checks offsets, sizes and overlaps against the buffer, copies each
        # tensor's bytes into a writable bytearray, and makes CPU tensors over them
        tensors = safetensors.torch.load(payload)
    except Exception as e:  # noqa: BLE001 - SafetensorError, KeyError on a dtype, torch errors
        raise _corrupt(f"tensor payload does not parse: {e}") from e
    except BaseException as e:  # pyo3 turns a Rust panic into PanicException, a BaseException
        if type(e).__name__ != "PanicException":
            raise
        raise _corrupt(f"tensor payload does not parse: {e}") from None
    if set(tensors) != {str(i) for i in range(len(tensors))}:
        raise _corrupt("tensor payload names are not 0, 1, ..., n-1")
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES or _DTYPE_NAMES[t.dtype] not in _TENSOR_DTYPES:
            raise _corrupt(f"tensor {name} has dtype {t.dtype}, not in the allow-list")
    return tensors
