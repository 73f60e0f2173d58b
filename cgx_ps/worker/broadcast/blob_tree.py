"""The structure half of a broadcast blob (``broadcast/blob_format.py``): values to plain JSON and back.

``encode_tree`` turns a value into JSON text plus the list of its tensors (referenced by index
from the JSON); ``decode_tree`` does the reverse on hostile input: JSON parsed with no
non-standard constants, bounded integer literals, no duplicate keys; markers checked against an
allow-list; every tensor referenced exactly once; nesting and container counts bounded. The
markers are listed in ``broadcast/blob_format.py``'s docstring.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any, NoReturn

import torch

from ..errors import BlobFormatError

__all__ = ["MAX_CONTAINERS", "MAX_DEPTH", "MAX_STRUCTURE_BYTES", "TENSOR_DTYPE_NAMES", "corrupt", "decode_tree",
           "encode_tree"]

# Limits, shared by the encoder (so that whatever encodes also decodes) and the decoder:
MAX_DEPTH = 64  # nested lists/tuples/dicts; state dicts need ~4, deeper is a bug or an attack
# The structure holds names and small values, not bulk data (that goes in tensors): 16 MiB is
# Adam's state for ~150k parameter tensors. Bounding it, and the number of containers in it,
# bounds what decoding allocates (an empty list costs ~40x its 2-3 bytes of JSON, so the worst
# structure peaks at ~250 MB of Python objects).
MAX_STRUCTURE_BYTES = 16 << 20
MAX_CONTAINERS = 1 << 20

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


def _containers(structure: bytes) -> int:
    # counts brackets inside strings too: an upper bound, which is all a limit needs
    return structure.count(b"[") + structure.count(b"{")


# ---------------------------------------------------------------- decoding


def corrupt(what: str) -> BlobFormatError:
    return BlobFormatError(f"corrupt broadcast blob: {what}")


def _reject_constant(name: str) -> NoReturn:
    raise corrupt(f"non-standard JSON constant {name}")  # NaN/Infinity: we never write them


def _parse_int(text: str) -> int:
    # we only write 64-bit ints as JSON numbers; refusing long ones keeps decimal parsing linear
    if len(text) > 20:
        raise corrupt("integer literal too long")
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise corrupt("duplicate key in a JSON object")
    return result


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.used: set[int] = set()

    def fail(self, path: _Path, what: str) -> NoReturn:
        raise corrupt(f"at {_format_path(path)}: {what}")

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


# Tensor dtypes a payload may hold, by name: what blobformat's payload check allows.
TENSOR_DTYPE_NAMES = {dtype: name for name, dtype in _TENSOR_DTYPES.items()}


def encode_tree(obj: Any) -> tuple[bytes, dict[str, torch.Tensor]]:
    """``obj`` as JSON text and its tensors (CPU copies, named "0", "1", ...). Raises
    BlobFormatError naming the path of the first value that cannot be sent, or when the
    structure is over the limits receivers accept."""
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
    return structure, encoder.tensors


def decode_tree(structure: bytes, tensors: dict[str, torch.Tensor]) -> Any:
    """The value ``encode_tree`` described, rebuilt from hostile bytes and the payload's
    tensors; every tensor must be used exactly once. Raises BlobFormatError for anything else."""
    if len(structure) > MAX_STRUCTURE_BYTES or _containers(structure) > MAX_CONTAINERS:
        raise corrupt(f"structure of {len(structure)} bytes is over this cgx-ps's limits")
    try:
        tree = json.loads(str(structure, "utf-8"), object_pairs_hook=_object,
                          parse_constant=_reject_constant, parse_int=_parse_int)
    except RecursionError:  # json's parser recurses per nesting level
        raise corrupt(f"structure nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise corrupt(f"structure is not valid JSON: {e}") from None
    decoder = _Decoder(tensors)
    try:
        obj = decoder.value(tree, None, 0)
    except RecursionError:  # cannot happen within MAX_DEPTH; here so no other type escapes
        raise corrupt("structure nested too deeply") from None
    if len(decoder.used) != len(tensors):
        raise corrupt(f"{len(tensors) - len(decoder.used)} tensors in the payload are never used")
    return obj
