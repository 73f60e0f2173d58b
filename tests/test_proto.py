"""The committed protocol stubs are fresh, the codec ids agree on both sides of the wire, and the
status codes the shard sends are the ones ps.proto documents."""

from __future__ import annotations

import filecmp
import re
import subprocess
import sys
from pathlib import Path

import grpc

from cgx_ps.kernels import Codec
from cgx_ps.v1 import ps_pb2

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", "cgx_ps/v1/ps.proto"],
        check=True, cwd=ROOT,
    )
    for name in ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"):
        fresh, committed = tmp_path / "cgx_ps/v1" / name, ROOT / "cgx_ps/v1" / name
        assert filecmp.cmp(fresh, committed, shallow=False), (
            f"cgx_ps/v1/{name} is stale: run scripts/gen_proto.sh and commit the result")


def test_codec_ids_match_proto_enum() -> None:
    proto = {name.removeprefix("CODEC_"): number for name, number in ps_pb2.Codec.items()
             if name != "CODEC_UNSPECIFIED"}
    assert proto == {c.name: int(c) for c in Codec}


# ---- status codes: one table from the shard's errors, documented in the .proto ---------------------


def _all_subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in {direct} | _all_subclasses(direct)}


def documented_status_codes() -> list[str]:
    """The codes listed under "Status codes" in ps.proto's header comment."""
    header = (ROOT / "protos/cgx_ps/v1/ps.proto").read_text().split("\nsyntax", 1)[0]
    section = header.split("// Status codes", 1)[1].split("\n//\n", 1)[0]
    return re.findall(r"^//   ([A-Z_]+) ", section, flags=re.M)


def test_the_proto_documents_every_status_code_the_shard_sends() -> None:
    from cgx_ps.server.rpc.gate import STATUS_CODES

    documented = documented_status_codes()
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == {code.name for code in STATUS_CODES.values()}


def test_every_domain_error_has_exactly_one_status() -> None:
    import cgx_ps.server.session.blobs  # noqa: F401 - its errors are subclasses too
    from cgx_ps.server.errors import ProtocolError
    from cgx_ps.server.rpc.gate import STATUS_CODES, grpc_status

    assert ProtocolError not in STATUS_CODES  # abstract: every refusal says which kind it is
    for cls in _all_subclasses(ProtocolError):
        mapped = [STATUS_CODES[c] for c in cls.__mro__ if c in STATUS_CODES]
        if not mapped and cls.__subclasses__():
            continue  # a grouping (BlobError): its subclasses say which kind
        assert mapped, f"{cls.__name__} has no status code in rpc.STATUS_CODES"
        assert grpc_status(cls("why")) == (mapped[0], "why")
        # a class reached through two bases must not be ambiguous
        assert len(set(mapped)) == 1, f"{cls.__name__} maps to {mapped}"


def test_blob_errors_keep_their_statuses() -> None:
    from cgx_ps.server.session.blobs import BadBlob, BlobError, BlobKeyTaken, BlobNotPut, BlobStoreFull
    from cgx_ps.server.rpc.gate import grpc_status

    expected = {BadBlob: grpc.StatusCode.INVALID_ARGUMENT, BlobStoreFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
                BlobKeyTaken: grpc.StatusCode.ALREADY_EXISTS, BlobNotPut: grpc.StatusCode.DEADLINE_EXCEEDED}
    for cls, code in expected.items():
        assert issubclass(cls, BlobError) and grpc_status(cls("x"))[0] == code


def test_domain_errors_carry_no_grpc_types() -> None:
    # the session and the rounds are the shard's domain: only rpc/ knows it speaks gRPC
    server = ROOT / "cgx_ps/server"
    modules = [server / "errors.py", *sorted((server / "session").glob("*.py")), *sorted((server / "rounds").glob("*.py"))]
    assert len(modules) > 8
    for module in modules:
        source = module.read_text()
        assert "import grpc" not in source and "StatusCode" not in source, module
