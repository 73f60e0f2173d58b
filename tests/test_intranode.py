"""Intra-node reduction (cgx_ps/worker/intranode.py, cuda_ipc.py) on its own: real processes,
real shared memory, exact sums; on a GPU, two processes on one device reduce through CUDA IPC
and must match the shared-memory result bit for bit. The end-to-end tests with shards (two
nodes of two ranks, a dead local rank) are in test_worker.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from cgx_ps.worker import ConfigError, IntraNodeError, WorkerConfig
from cgx_ps.worker.intranode import SHM_DIR, NodeReducer, _Segment, choose_transport

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/workers"))
import reduce_worker  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                         reason="needs a CUDA GPU and CuPy (CUDA IPC goes through cupy.cuda.runtime)")


def _cupy_ok() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def _shm_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob("cgxps-*")}


def run_node(tmp_path: Path, size: int, device: str = "cpu", transport: str = "auto", steps: int = 3) -> list[dict]:
    job = f"t-{uuid.uuid4().hex[:8]}"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/workers/reduce_worker.py"), "--local-rank", str(r),
                               "--size", str(size), "--job", job, "--device", device, "--transport", transport,
                               "--steps", str(steps), "--out", str(tmp_path / f"{job}-{r}.pt")],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), stderr=subprocess.PIPE, text=True)
             for r in range(size)]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, f"local rank {r}:\n{err[-3000:]}"
    return [torch.load(tmp_path / f"{job}-{r}.pt") for r in range(size)]


def expected(size: int, steps: int, owners: list[int]) -> list[torch.Tensor]:
    """The owner adds the others' gradients to its own in rank order, then halves."""
    lay = reduce_worker.layout()
    bounds = [0]
    for b in lay.blocks:
        bounds.append(bounds[-1] + b.numel)
    out = []
    for step in range(steps):
        grads = [reduce_worker.gradient(r, step, bounds[-1]) for r in range(size)]
        total = torch.empty(bounds[-1])
        for b, owner in enumerate(owners):
            s = slice(bounds[b], bounds[b + 1])
            acc = grads[owner][s].clone()
            for r in range(size):
                if r != owner:
                    acc.add_(grads[r][s])
            total[s] = acc * 0.5
        out.append(total)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_reduce_scatter_all_gather_is_exact(tmp_path, size):
    before = _shm_files()
    saved = run_node(tmp_path, size)
    owners = saved[0]["owners"]
    assert len(set(owners)) == size  # every local rank owns (sums, would compress) some blocks
    want = expected(size, 3, owners)
    for r, s in enumerate(saved):
        assert s["transport"] == "shm"
        for step, (got, exp) in enumerate(zip(s["results"], want)):
            assert torch.equal(got, exp), (r, step)
    assert _shm_files() == before


def test_cuda_transport_needs_the_model_on_a_gpu():
    with pytest.raises(ConfigError, match="CGX_PS_INTRANODE=cuda needs the model on a GPU"):
        choose_transport("cuda", torch.device("cpu"))
    assert choose_transport("auto", torch.device("cpu")) == "shm"
    # a GPU model goes over CUDA IPC when CuPy can make the IPC calls, else through host memory
    assert choose_transport("auto", torch.device("cuda", 0)) == ("cuda" if _cupy_ok() else "shm")
    assert choose_transport("shm", torch.device("cuda", 0)) == "shm"  # staging through host memory


def test_bad_transport_in_the_environment_is_named():
    with pytest.raises(ConfigError, match="CGX_PS_INTRANODE='nccl' is not one of auto, shm, cuda"):
        WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_INTRANODE": "nccl"})
    assert WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_INTRANODE": "SHM"}).intranode == "shm"


def _fake_peer(job: str, rank: int, **kw) -> Path:
    """A peer's segment as another local rank would have published it (our pid: alive)."""
    path = SHM_DIR / f"cgxps-{job}-n0-r{rank}"
    _Segment(path, create=True, **kw)
    return path


_NBLOCKS = len(reduce_worker.layout().blocks)
_NUMEL = sum(b.numel for b in reduce_worker.layout().blocks)


@pytest.mark.parametrize("peer, message", [
    (dict(nblocks=_NBLOCKS, transport="cuda", export=b"{}"), "local rank 1 reduces over cuda but this rank over shm"),
    (dict(nblocks=_NBLOCKS + 1, transport="shm", host_numel=_NUMEL + 5), "do the local ranks build the same model"),
])
def test_a_peer_that_disagrees_is_named(peer, message):
    job = f"t-{uuid.uuid4().hex[:8]}"
    path = _fake_peer(job, 1, **peer)
    try:
        with pytest.raises(IntraNodeError, match=message):
            NodeReducer(reduce_worker.layout(), 0, 2, 0, job, timeout_s=5)
    finally:
        path.unlink(missing_ok=True)
    assert not any(job in name for name in _shm_files())  # our own segment is gone too


def test_a_missing_peer_times_out_with_its_rank():
    lay = reduce_worker.layout()
    job = f"t-{uuid.uuid4().hex[:8]}"
    with pytest.raises(IntraNodeError, match=r"local rank 1 did not start within 0.5s"):
        NodeReducer(lay, 0, 2, 0, job, timeout_s=0.5)
    assert not any(job in name for name in _shm_files())  # our own segment is gone too


# ---- CUDA IPC (skipped without a GPU) ----------------------------------------------------------------


@gpu
@pytest.mark.parametrize("device", ["cuda:0", pytest.param("cuda:{rank}", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))])
def test_cuda_ipc_matches_shared_memory(tmp_path, device):
    """Two processes (on one GPU, or one GPU each) reduce through CUDA IPC, bit-identical to
    the shared-memory path; their buffers sit inside larger allocations (offset > 0)."""
    before = _shm_files()
    on_gpu = run_node(tmp_path, 2, device=device)
    on_host = run_node(tmp_path, 2)
    assert [s["transport"] for s in on_gpu] == ["cuda", "cuda"]
    assert all(s["offset_bytes"] > 0 for s in on_gpu), [s["offset_bytes"] for s in on_gpu]
    want = expected(2, 3, on_gpu[0]["owners"])
    for r in range(2):
        for step in range(3):
            assert torch.equal(on_gpu[r]["results"][step], on_host[r]["results"][step]), (r, step)
            assert torch.equal(on_gpu[r]["results"][step], want[step]), (r, step)
    assert _shm_files() == before


@gpu
def test_cuda_model_staged_through_host_memory_when_asked(tmp_path):
    saved = run_node(tmp_path, 2, device="cuda:0", transport="shm")
    assert [s["transport"] for s in saved] == ["shm", "shm"]
    want = expected(2, 3, saved[0]["owners"])
    for r in range(2):
        assert all(torch.equal(g, e) for g, e in zip(saved[r]["results"], want))


def test_flags_store_and_load_through_the_fence():
    import numpy as np

    from cgx_ps.worker.shm_flags import load_acquire, store_release

    flags = np.zeros(4, dtype=np.int64)
    store_release(flags, 2, 7)
    assert flags.tolist() == [0, 0, 7, 0] and load_acquire(flags, 2) == 7 and load_acquire(flags, 0) == 0
    store_release(flags, 2, 2**40)  # step counters do not wrap at 32 bits
    assert load_acquire(flags, 2) == 2**40


@pytest.mark.parametrize("record, message", [
    (b"not json", "cannot map another local rank's GPU buffer"),
    (b'{"events": ["00"], "offset_bytes": 0, "numel": 1, "allocation_bytes": 4}', "exported 1 block events, expected 2"),
    (b'{"events": ["00", "00"], "offset_bytes": 8, "numel": 4, "allocation_bytes": 16}', "does not fit its allocation"),
])
def test_a_bad_cuda_ipc_record_is_named_before_any_cuda_call(record, message):
    from cgx_ps.worker.cuda_ipc import CudaIpcBuffer

    with pytest.raises(IntraNodeError, match=message):
        CudaIpcBuffer.open(record, 2, torch.device("cuda", 0))
