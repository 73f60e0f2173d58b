"""The committed protocol stubs are fresh, and the codec ids agree on both sides of the wire."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

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
