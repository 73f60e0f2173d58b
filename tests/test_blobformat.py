"""Broadcast blob format: exact round trips of what training broadcasts, and hostile input that
only ever yields BlobFormatError (never code execution, another exception, a hang or a huge
allocation)."""

from __future__ import annotations

import collections
import io
import json
import math
import pickle
import random
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgx_ps.worker.broadcast.blob_format import BlobFormatError, decode_object, encode_object
from cgx_ps.worker.broadcast import blob_format as blobformat
from cgx_ps.worker.errors import CgxPsError


# ---------------------------------------------------------------- helpers


def _bits(t: torch.Tensor) -> bytes:
    """The tensor's raw bytes (so nan payloads, -0.0 and bf16 compare exactly)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a, b) -> bool:
    """Exact structural equality: same types, same key order, bit-identical tensors."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu"
                and _bits(a) == _bits(b))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (len(a) == len(b) and all(_same(ka, kb) and _same(a[ka], b[kb])
                                         for ka, kb in zip(a, b)))
    return a == b


def _round_trip(obj):
    decoded = decode_object(encode_object(obj))
    assert _same(obj, decoded), (obj, decoded)
    return decoded


def _pack(structure: bytes, payload: bytes, version: int = blobformat.FORMAT_VERSION) -> bytes:
    """A blob with correct framing around arbitrary (possibly hostile) sections."""
    return (blobformat.MAGIC + struct.pack("<I", version) + struct.pack("<Q", len(structure))
            + structure + struct.pack("<Q", len(payload)) + payload)


def _sections(blob: bytes) -> tuple[bytes, bytes]:
    n = struct.unpack_from("<Q", blob, 12)[0]
    structure = blob[20:20 + n]
    m = struct.unpack_from("<Q", blob, 20 + n)[0]
    return structure, blob[28 + n:28 + n + m]


def _decode_or_format_error(data: bytes) -> None:
    """Decoding either succeeds or raises BlobFormatError; anything else fails the test."""
    try:
        decode_object(data)
    except BlobFormatError:
        pass


_EMPTY_PAYLOAD = safetensors.torch.save({})
_ONE_TENSOR = safetensors.torch.save({"0": torch.arange(3, dtype=torch.float32)})


def _small_blob() -> bytes:
    return encode_object({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                          "state": {0: {"step": torch.tensor(3.0), "buf": torch.ones(2)}},
                          "groups": [{"lr": 0.1, "params": [0], "nesterov": False, "x": None}],
                          "t": (1, "a", float("inf"))})


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.conv = torch.nn.Conv1d(4, 6, 3)
        self.bn = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(self.embed(x).transpose(1, 2)))
        return self.head(h.mean(dim=2))


def _trained(opt_factory, steps: int = 3):
    torch.manual_seed(0)
    net = _Net()
    opt = opt_factory(net.parameters())
    for i in range(steps):
        x = torch.randint(0, 10, (5, 7), generator=torch.Generator().manual_seed(i))
        loss = net(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, opt


# ---------------------------------------------------------------- round trips


def test_module_state_dict_round_trips_and_loads() -> None:
    net, _ = _trained(lambda p: torch.optim.SGD(p, lr=0.1))
    sd = net.state_dict()
    decoded = decode_object(encode_object(sd))
    assert type(decoded) is dict and list(decoded) == list(sd)  # OrderedDict -> dict, order kept
    for name, t in sd.items():
        assert _same(t, decoded[name]), name
    assert decoded["bn.num_batches_tracked"].dtype == torch.int64
    assert decoded["bn.num_batches_tracked"].dim() == 0
    fresh = _Net()
    fresh.load_state_dict(decoded)
    for (name, a), b in zip(sd.items(), fresh.state_dict().values()):
        assert _bits(a) == _bits(b), name


@pytest.mark.parametrize("factory", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.95), amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=1e-3),
], ids=["sgd-momentum", "adam-amsgrad", "adamw"])
def test_optimizer_state_dict_round_trips_and_continues_identically(factory) -> None:
    net, opt = _trained(factory)
    sd = opt.state_dict()
    assert sd["state"], "the optimizer has state after steps"
    decoded = _round_trip(sd)
    assert all(type(k) is int for k in decoded["state"])  # int keys survive
    assert type(decoded["param_groups"][0]["params"]) is list
    if "betas" in sd["param_groups"][0]:
        assert type(decoded["param_groups"][0]["betas"]) is tuple

    # a second replica loads the decoded state and takes the same step, bit for bit
    twin = _Net()
    twin.load_state_dict(net.state_dict())
    twin_opt = factory(twin.parameters())
    twin_opt.load_state_dict(decoded)
    x = torch.randint(0, 10, (5, 7), generator=torch.Generator().manual_seed(99))
    for model, o in ((net, opt), (twin, twin_opt)):
        o.zero_grad()
        model(x).square().mean().backward()
        o.step()
    for a, b in zip(net.parameters(), twin.parameters()):
        assert _bits(a) == _bits(b)
    assert all(t.device.type == "cpu" for s in decoded["state"].values()
               for t in s.values() if isinstance(t, torch.Tensor))


def test_nested_values_and_special_floats() -> None:
    obj = {
        "none": None, "bools": [True, False], "ints": [0, -1, 2**63 - 1, -2**63, 2**63, -2**200,
                                                    10**400],
        "floats": [0.0, -0.0, 1.5, 1e-310, 1.7976931348623157e308, float("nan"), float("inf"),
                   float("-inf")],
        "str": ["", "ünïcödé ✓", "\x00", "\ud800", '{"$tensor": 0}', "$tensor"],
        "tuple": (1, (2, (3, [4, (5,)])), ()),
        "empty": [[], {}, ()],
        "bytes": [b"", b"\x00\xff" * 100],
        "torch": [torch.Size([2, 0, 3]), torch.Size([]), torch.float32, torch.bfloat16, torch.bool,
                  torch.complex128, torch.device("cpu"), torch.device("cuda", 1),
                  torch.device("meta")],
        "$tensor": {"$$x": {"$": 1}},  # keys that look like markers are escaped
        "deep": [[[[[[[[{"a": ({"b": [1]},)}]]]]]]]],
    }
    _round_trip(obj)
    for x in (None, True, 3, 2.5, float("nan"), "s", b"b", [], {}, (), torch.tensor(1.0)):
        _round_trip(x)  # any value at the top level


def test_dict_key_types_and_order() -> None:
    od = collections.OrderedDict()
    for key in ["z", 3, -7, 2**70, 1.5, float("inf"), False, None, (1, "a", None), (), ((2,), 3.0),
                "a", "$x"]:
        od[key] = repr(key)
    decoded = decode_object(encode_object(od))
    assert type(decoded) is dict
    assert list(decoded) == list(od)
    assert [type(k) for k in decoded] == [type(k) for k in od]
    assert decoded == dict(od)
    _round_trip({0: {1: {"x": 2}}, "s": {(0, 1): 3}})


def test_subclasses_are_sent_as_their_base_type() -> None:
    import enum

    class Color(enum.IntEnum):
        RED = 3

    dd = collections.defaultdict(list, {"a": [1]})
    assert decode_object(encode_object([Color.RED, dd])) == [3, {"a": [1]}]
    assert type(decode_object(encode_object(Color.RED))) is int


@pytest.mark.parametrize("tensor", [
    torch.tensor(3.25), torch.tensor(True), torch.tensor(7, dtype=torch.int64),
    torch.randn(3, 4).to(torch.bfloat16), torch.randn(5).half(), torch.rand(4, 4) > 0.5,
    torch.randint(-2**62, 2**62, (6,), dtype=torch.int64), torch.arange(256, dtype=torch.uint8),
    torch.arange(-8, 8, dtype=torch.int8), torch.randn(2, 2, dtype=torch.float64),
    torch.randn(3, dtype=torch.complex64), torch.zeros(0), torch.zeros(2, 0, 3, dtype=torch.int32),
    torch.tensor([float("nan"), -0.0, float("inf")]),
    torch.randn(4, 5).t(), torch.randn(6, 6)[1::2, ::3], torch.randn(3, 1).expand(3, 4),
    torch.randn(2, 3, requires_grad=True), torch.nn.Parameter(torch.ones(2)),
], ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_tensor_round_trip(tensor: torch.Tensor) -> None:
    before = _bits(tensor)
    decoded = decode_object(encode_object(tensor))
    assert type(decoded) is torch.Tensor and not decoded.requires_grad
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert decoded.device.type == "cpu" and decoded.is_contiguous()
    assert _bits(decoded) == _bits(tensor)
    decoded.zero_()  # writable (safetensors hands out bytearray-backed tensors), and a copy
    assert _bits(tensor) == before


def test_views_of_one_storage_and_repeated_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = {"base": base, "row": base[1], "col": base[:, 2], "t": base.t(), "flat": base.view(-1),
             "strided": base[::2, 1::2], "again": base, "scalar": base[0, 0]}
    decoded = _round_trip(views)
    ptrs = {v.untyped_storage().data_ptr() for v in decoded.values() if v.numel()}
    assert len(ptrs) == len(decoded)  # independent copies: safetensors refuses shared storage
    decoded["base"].fill_(-1)
    assert decoded["again"][0, 0] == 0 and decoded["row"][0] == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_arrive_on_cpu() -> None:
    t = torch.randn(4, 5, device="cuda").t()
    decoded = decode_object(encode_object({"t": t, "dev": t.device}))
    assert decoded["t"].device.type == "cpu" and _bits(decoded["t"]) == _bits(t)
    assert decoded["dev"] == t.device


def test_decode_accepts_bytearray_and_memoryview() -> None:
    blob = _small_blob()
    for data in (bytearray(blob), memoryview(blob)):
        assert _same(decode_object(blob), decode_object(data))
    with pytest.raises(TypeError):
        decode_object("not bytes")  # type: ignore[arg-type]


def test_limits_round_trip_at_the_edge() -> None:
    nested: list = []
    inner = nested
    for _ in range(blobformat.MAX_DEPTH - 1):
        inner.append([])
        inner = inner[0]
    inner.append(torch.ones(1))
    _round_trip(nested)  # exactly MAX_DEPTH containers deep
    with pytest.raises(BlobFormatError, match="deeper than 64"):
        encode_object([nested])


# ---------------------------------------------------------------- encode errors


def _cycle() -> list:
    x: list = []
    x.append(x)
    return x


class _Thing:
    pass


@pytest.mark.parametrize("obj, message", [
    ({"state": {3: {"foo": {1, 2}}}}, r"^obj\['state'\]\[3\]\['foo'\]: cannot broadcast a set"),
    ([1, (2, lambda: 3)], r"^obj\[1\]\[1\]: cannot broadcast a function"),
    ({"a": [_Thing()]}, r"^obj\['a'\]\[0\]: cannot broadcast a .*_Thing"),
    ({"cls": _Thing}, r"^obj\['cls'\]: cannot broadcast the class _Thing"),
    ({"k": {frozenset(): 1}}, r"^obj\['k'\]\[frozenset\(\)\]: cannot broadcast a frozenset as a dict key"),
    ({"k": {(1, torch.float32): 1}}, r"^obj\[.k.\]\[\(1, torch.float32\)\]\[1\]: cannot broadcast a torch.dtype as a dict key"),
    ([bytearray(b"x")], r"^obj\[0\]: cannot broadcast a bytearray: convert it to bytes"),
    (collections.namedtuple("P", "x")(1), r"^obj: cannot broadcast .*P: convert it to a plain tuple"),
    ({"sp": torch.eye(3).to_sparse()}, r"^obj\['sp'\]: cannot broadcast a tensor of layout"),
    ({"m": torch.empty(3, device="meta")}, r"^obj\['m'\]: cannot broadcast a meta tensor"),
    ({"c": torch.zeros(2, dtype=torch.complex128)}, r"^obj\['c'\]: cannot broadcast a tensor of dtype"),
    (_cycle(), r"nested deeper than 64 levels \(a cycle\?\)"),
    (io.BytesIO(), r"^obj: cannot broadcast a _io.BytesIO"),
])
def test_encode_errors_name_the_path(obj, message) -> None:
    with pytest.raises(BlobFormatError, match=message) as info:
        encode_object(obj)
    assert isinstance(info.value, CgxPsError)


def test_encode_refuses_shared_subtree_explosion(monkeypatch) -> None:
    monkeypatch.setattr(blobformat, "MAX_CONTAINERS", 10_000)  # the real 1M takes seconds to reach
    node: list = [1]
    for _ in range(40):  # 2**40 leaves if expanded
        node = [node, node]
    with pytest.raises(BlobFormatError, match="more than"):
        encode_object(node)


# ---------------------------------------------------------------- decode errors


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling creates the marker file


def test_planted_pickle_is_rejected_without_running_it(tmp_path) -> None:
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Evil(str(proof)))).close()
    assert proof.exists()  # the payload is live: unpickling it does run code

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"x": _Evil(str(marker))}, buf)
    for planted in (pickle.dumps(_Evil(str(marker))), pickle.dumps(_Evil(str(marker)), protocol=0),
                    buf.getvalue()):
        with pytest.raises(BlobFormatError, match="^not a cgx-ps broadcast blob: was it written by "
                                                  "an older cgx-ps or by something else\\?$"):
            decode_object(planted)
    assert not marker.exists()


def test_every_truncation_is_a_format_error() -> None:
    blob = _small_blob()
    assert len(blob) < 2000
    for cut in range(len(blob)):
        with pytest.raises(BlobFormatError):
            decode_object(blob[:cut])
    with pytest.raises(BlobFormatError, match="unexpected bytes after"):
        decode_object(blob + b"\x00")


def test_framing_errors() -> None:
    structure, payload = _sections(_small_blob())
    assert _same(decode_object(_pack(structure, payload)), decode_object(_small_blob()))
    with pytest.raises(BlobFormatError, match="version 2, but this cgx-ps reads version 1"):
        decode_object(_pack(structure, payload, version=2))
    for huge in (2**60, 2**64 - 1):
        claim = blobformat.MAGIC + struct.pack("<IQ", 1, huge) + b"{}"
        with pytest.raises(BlobFormatError, match="exceeds"):
            decode_object(claim)
        claim = (blobformat.MAGIC + struct.pack("<IQ", 1, 2) + b"{}" + struct.pack("<Q", huge)
                 + _EMPTY_PAYLOAD)
        with pytest.raises(BlobFormatError, match="exceeds"):
            decode_object(claim)
    for not_blob in (b"PK\x03\x04" + b"\x00" * 40, b"\x80\x04K\x01.", b"x" * 100, b"\x89CGXBC\r\r"):
        with pytest.raises(BlobFormatError, match="not a cgx-ps broadcast blob"):
            decode_object(not_blob)
    with pytest.raises(BlobFormatError, match="truncated"):
        decode_object(b"")


def test_deep_nesting_bombs() -> None:
    for n in (65, 1000, 100_000):
        for opener, closer in ((b"[", b"]"), (b'{"a":', b"}"), (b'{"$tuple":[', b"]}")):
            bomb = opener * n + b"1" + closer * n
            with pytest.raises(BlobFormatError, match="nested deeper|over this"):
                decode_object(_pack(bomb, _EMPTY_PAYLOAD))
    key_bomb = b'{"$dict":[' + b'{"$tuple":[' * 200 + b"1" + b"]}" * 200 + b",1]}"
    with pytest.raises(BlobFormatError, match="nested deeper"):
        decode_object(_pack(key_bomb, _EMPTY_PAYLOAD))


def test_structure_size_limits() -> None:
    many = b"[" + b"[]," * blobformat.MAX_CONTAINERS + b"[]]"  # ~3 MiB, 1M empty lists
    with pytest.raises(BlobFormatError, match="over this cgx-ps's limits"):
        decode_object(_pack(many, _EMPTY_PAYLOAD))
    big = b'"' + b"a" * (blobformat.MAX_STRUCTURE_BYTES + 1) + b'"'
    with pytest.raises(BlobFormatError, match="over this cgx-ps's limits"):
        decode_object(_pack(big, _EMPTY_PAYLOAD))
    with pytest.raises(BlobFormatError, match="over the limits receivers accept"):
        encode_object("a" * blobformat.MAX_STRUCTURE_BYTES)


@pytest.mark.parametrize("structure, payload, message", [
    (b'{"$tensor":1}', _ONE_TENSOR, "payload lacks"),
    (b'{"$tensor":-1}', _ONE_TENSOR, "payload lacks"),
    (b'{"$tensor":true}', _ONE_TENSOR, "payload lacks"),
    (b'{"$tensor":0.0}', _ONE_TENSOR, "payload lacks"),
    (b'{"$tensor":"0"}', _ONE_TENSOR, "payload lacks"),
    (b'[{"$tensor":0},{"$tensor":0}]', _ONE_TENSOR, "referenced twice"),
    (b"[]", _ONE_TENSOR, "never used"),
    (b'{"$pickle":"gASVAAAA"}', _EMPTY_PAYLOAD, "unknown marker"),
    (b'{"$tensor":0,"b":1}', _ONE_TENSOR, "only key"),
    (b'{"$dtype":"os.system"}', _EMPTY_PAYLOAD, "unknown marker"),
    (b'{"$dtype":"__class__"}', _EMPTY_PAYLOAD, "unknown marker"),
    (b'{"$device":"cuda:x"}', _EMPTY_PAYLOAD, "bad device"),
    (b'{"$device":"evil"}', _EMPTY_PAYLOAD, "bad device"),
    (b'{"$size":[-1]}', _EMPTY_PAYLOAD, "unknown marker"),
    (b'{"$size":[true]}', _EMPTY_PAYLOAD, "unknown marker"),
    (b'{"$bytes":"!!"}', _EMPTY_PAYLOAD, "bad base64"),
    (b'{"$bytes":"\\u00e9"}', _EMPTY_PAYLOAD, "bad base64"),
    (b'{"$int":"12"}', _EMPTY_PAYLOAD, "bad \\$int"),
    (b'{"$float":"1.0"}', _EMPTY_PAYLOAD, "bad \\$float"),
    (b'{"$dict":[1]}', _EMPTY_PAYLOAD, "unknown marker"),
    (b'{"$dict":[[1],2]}', _EMPTY_PAYLOAD, "dict key must be"),
    (b'{"$dict":[{"$tensor":0},2]}', _ONE_TENSOR, "dict key must be"),
    (b'{"$dict":[1,2,1,3]}', _EMPTY_PAYLOAD, "duplicate key"),
    (b'{"$dict":[1,2,true,3]}', _EMPTY_PAYLOAD, "duplicate key"),
    (b'{"a":1,"a":2}', _EMPTY_PAYLOAD, "duplicate key"),
    (b'{"$tuple":{"a":1}}', _EMPTY_PAYLOAD, "unknown marker"),
    (b"[NaN]", _EMPTY_PAYLOAD, "non-standard JSON"),
    (b"[-Infinity]", _EMPTY_PAYLOAD, "non-standard JSON"),
    (b"[" + b"9" * 5000 + b"]", _EMPTY_PAYLOAD, "too long"),
    (b"[1,", _EMPTY_PAYLOAD, "not valid JSON"),
    (b"", _EMPTY_PAYLOAD, "not valid JSON"),
    (b'"\xff"', _EMPTY_PAYLOAD, "not valid JSON"),
    (b"1", b"", "does not parse"),
    (b"1", b"garbage!" * 4, "does not parse"),
    (b'{"$tensor":0}', safetensors.torch.save({"a": torch.ones(1)}), "names are not"),
    (b"[]", safetensors.torch.save({"1": torch.ones(1)}), "names are not"),
])
def test_hostile_structures(structure, payload, message) -> None:
    with pytest.raises(BlobFormatError, match=message):
        decode_object(_pack(structure, payload))


def _safetensors_with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("header, data", [
    ({"0": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 4]}}, b"\x00" * 4),
    ({"0": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]}}, b"\x00" * 4),
    ({"0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 2**60]}}, b"\x00" * 4),
    ({"0": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\x00" * 4),
    ({"0": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 4),
    ({"0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "1": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 4),  # overlap
    ({"0": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}, b""),
], ids=["huge-shape", "overflowing-shape", "huge-offset", "reversed-offsets", "unknown-dtype",
        "overlapping", "empty-overflowing-shape"])
def test_hostile_safetensors_payloads(header, data) -> None:
    refs = b"[" + b",".join(b'{"$tensor":%d}' % i for i in range(len(header))) + b"]"
    try:
        obj = decode_object(_pack(refs, _safetensors_with_header(header, data)))
    except BlobFormatError:
        return
    # if one ever parses, it must not have conjured more tensor bytes than the payload holds
    assert sum(t.numel() * t.element_size() for t in obj) <= len(data)


# ---------------------------------------------------------------- fuzzing


_FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])
_VALID = _small_blob()
_STRUCTURE, _PAYLOAD = _sections(_VALID)


@_FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_format_error(data)
    _decode_or_format_error(blobformat.MAGIC + data)
    _decode_or_format_error(blobformat.MAGIC + struct.pack("<I", 1) + data)


def _mutate(base: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(base)
    for kind, pos, value in edits:
        if not out:
            out.append(value)
            continue
        pos %= len(out)
        if kind == 0:
            out[pos] = value
        elif kind == 1:
            out.insert(pos, value)
        elif kind == 2:
            del out[pos]
        else:
            out[pos] ^= 1 << (value % 8)
    return bytes(out)


_EDITS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 255)),
                  min_size=1, max_size=6)


@_FUZZ
@given(_EDITS)
def test_fuzz_mutated_blob(edits) -> None:
    _decode_or_format_error(_mutate(_VALID, edits))


@_FUZZ
@given(_EDITS, st.booleans())
def test_fuzz_mutated_sections_with_valid_framing(edits, in_structure: bool) -> None:
    # re-framed so that mutations reach the JSON walker and the safetensors parser
    if in_structure:
        _decode_or_format_error(_pack(_mutate(_STRUCTURE, edits), _PAYLOAD))
    else:
        _decode_or_format_error(_pack(_STRUCTURE, _mutate(_PAYLOAD, edits)))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
    | st.sampled_from(["$tensor", "$tuple", "$dict", "$int", "$float", "$bytes", "$size", "$dtype",
                       "$device", "$$", "float32", "cuda:0", "nan", "0x1"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["$tensor", "$tuple", "$dict", "$int", "$float", "$bytes", "$size",
                         "$dtype", "$device", "$$a", "a", "$"]), children, max_size=2),
    max_leaves=12)


@_FUZZ
@given(_JSON)
def test_fuzz_arbitrary_json_structures(tree) -> None:
    structure = json.dumps(tree, allow_nan=True).encode()
    _decode_or_format_error(_pack(structure, _ONE_TENSOR))
    _decode_or_format_error(_pack(structure, _EMPTY_PAYLOAD))


_KEYS = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                     lambda k: st.tuples(k, k), max_leaves=4)
_TENSORS = st.builds(lambda shape, dtype: torch.ones(shape, dtype=dtype),
                     st.lists(st.integers(0, 3), max_size=3),
                     st.sampled_from([torch.float32, torch.bfloat16, torch.bool, torch.int64]))
_VALUES = st.recursive(
    _KEYS | st.binary(max_size=8) | _TENSORS,
    lambda children: (st.lists(children, max_size=3) | st.tuples(children, children)
                      | st.dictionaries(_KEYS, children, max_size=3)),
    max_leaves=15)


@settings(_FUZZ, max_examples=150)
@given(_VALUES)
def test_fuzz_round_trip(obj) -> None:
    _round_trip(obj)


# ---- a broadcast is striped over the shards (worker/shards/engine.py) ----------------------------


@pytest.mark.parametrize("size, n", [(0, 1), (0, 3), (2, 3), (10, 1), (10, 3), (1 << 20, 8), (1000003, 7)])
def test_stripes_cut_a_blob_into_one_contiguous_part_per_shard(size, n):
    from cgx_ps.worker.shards.engine import stripes

    data = bytes(random.Random(size).getrandbits(8) for _ in range(min(size, 4096))) * (size // 4096 + 1)
    data = data[:size]
    parts = stripes(data, n)
    assert len(parts) == n and b"".join(parts) == data
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # every shard's link carries its 1/n
