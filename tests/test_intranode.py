"""Intra-node reduction (cgx_ps/worker/intranode/reduction.py, segment.py, rendezvous.py, cuda_ipc.py) on
its own: real processes, real sockets and memfds, exact sums; on a GPU, two processes on one device reduce through CUDA
IPC and must match the shared-memory result bit for bit. The rendezvous is attacked with real
processes too: squatters, another user's peer (forked and setuid to nobody, as root), foreign
segments, kill -9 at each stage of start-up. The end-to-end tests with shards (two nodes of
two ranks, a dead local rank) are in test_worker.py."""

from __future__ import annotations

import array
import asyncio
import gc
import importlib.util
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from cgx_ps.worker import ConfigError, IntraNodeError, WorkerConfig
from cgx_ps.worker.gpu_setup import peer_access_table
from cgx_ps.worker.intranode.reduction import NodeReducer, choose_transport
from cgx_ps.worker.intranode.rendezvous import _HELLO, _RDV_MAGIC, rendezvous_name
from cgx_ps.worker.intranode.segment import _MAGIC, Segment
from workers import reduce_worker
from workers.warm_start import start_worker

ROOT = Path(__file__).resolve().parents[1]

gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                         reason="needs a CUDA GPU and CuPy (CUDA IPC goes through cupy.cuda.runtime)")
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a fake peer as another user (nobody)")
NOBODY = 65534
SHM = Path("/dev/shm")


def _cupy_ok() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def _shm_files() -> set[str]:
    return {p.name for p in SHM.glob("cgxps*")} if SHM.is_dir() else set()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _descriptors() -> dict[int, str]:
    """This process's descriptors and what they point to."""
    out = {}
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the one listdir itself had open
            pass
    return out


def _names() -> tuple[str, str]:
    """A job id and a random run tag (the session id in training), as every rank gets them."""
    return f"t-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex


def _worker(rank: int, size: int, job: str, tag: str, out: Path, *, device: str = "cpu", transport: str = "auto",
            steps: int = 3, timeout: float = 30) -> subprocess.Popen:
    return start_worker([sys.executable, str(ROOT / "tests/workers/reduce_worker.py"), "--local-rank", str(rank),
                         "--size", str(size), "--job", job, "--run-tag", tag, "--device", device,
                         "--transport", transport, "--steps", str(steps), "--timeout", str(timeout),
                         "--out", str(out)],
                        env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)


def run_node(tmp_path: Path, size: int, device: str = "cpu", transport: str = "auto", steps: int = 3) -> list[dict]:
    job, tag = _names()
    procs = [_worker(r, size, job, tag, tmp_path / f"{job}-{r}.pt", device=device, transport=transport, steps=steps)
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
    saved = run_node(tmp_path, size)
    owners = saved[0]["owners"]
    assert len(set(owners)) == size  # every local rank owns (sums, would compress) some blocks
    want = expected(size, 3, owners)
    for r, s in enumerate(saved):
        assert s["transport"] == "shm"
        for step, (got, exp) in enumerate(zip(s["results"], want)):
            assert torch.equal(got, exp), (r, step)
    assert _shm_files() == set()  # segments are memfds: never a file in /dev/shm


def test_blocks_are_balanced_largest_first_over_shards_and_over_local_ranks():
    from cgx_ps.model_layout import block_payload_size
    from cgx_ps.worker.intranode.reduction import assign_owners
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout, largest_first

    assert largest_first([5, 9, 5, 2, 7], 2) == [1, 0, 0, 1, 1]  # 9, 7, then each to the lighter bin
    assert largest_first([], 3) == [] and largest_first([4, 4, 4], 3) == [0, 1, 2]
    sizes = [int(x) for x in torch.randint(1, 1000, (40,), generator=torch.Generator().manual_seed(0))]
    loads = [0] * 3
    for size, b in zip(sizes, largest_first(sizes, 3)):
        loads[b] += size
    assert max(loads) - min(loads) <= max(sizes)  # largest first: within one item of each other
    layout = build_layout([TensorInfo(f"t{i}", (i + 1, 3000)) for i in range(6)], 3, Compression(), block_bytes=8192)
    payload = [block_payload_size(b) for b in layout.blocks]
    assert [b.shard for b in layout.blocks] == largest_first(payload, 3)
    assert assign_owners(layout, 2) == largest_first(payload, 2)


def test_cuda_transport_needs_the_model_on_a_gpu():
    with pytest.raises(ConfigError, match="CGX_PS_INTRANODE=cuda needs the model on a GPU"):
        choose_transport("cuda", torch.device("cpu"))
    assert choose_transport("auto", torch.device("cpu")) == "shm"
    # a GPU model goes over CUDA IPC when CuPy can make the IPC calls and the GPUs can map each
    # other's memory (gpu_setup.decide_transport, tested in test_gpu_setup.py), else through host memory
    mappable = all(peer_access_table(torch.cuda.device_count()).values())
    assert choose_transport("auto", torch.device("cuda", 0)) == ("cuda" if _cupy_ok() and mappable else "shm")
    assert choose_transport("shm", torch.device("cuda", 0)) == "shm"  # staging through host memory


def test_bad_transport_in_the_environment_is_named():
    with pytest.raises(ConfigError, match="CGX_PS_INTRANODE='nccl' is not one of auto, shm, cuda"):
        WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_INTRANODE": "nccl"})
    assert WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_INTRANODE": "SHM"}).intranode == "shm"


_NBLOCKS = len(reduce_worker.layout().blocks)
_NUMEL = sum(b.numel for b in reduce_worker.layout().blocks)


# ---- fake local ranks: forked children that speak the rendezvous protocol by hand ------------------


def _fork(fn, *args) -> int:
    """Run ``fn(*args)`` in a child process; its return value is the exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn(*args)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _reap(pid: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} hung")


def _connect(name: bytes, timeout: float = 60) -> socket.socket:
    # generous: a real rank 0 imports torch first, which takes seconds on a loaded machine
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(name)
            return sock
        except ConnectionRefusedError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _good_segment(**kw) -> int:
    return Segment.create(**{"nblocks": _NBLOCKS, "host_numel": _NUMEL, **kw})[1]


def _raw_segment(magic: int = _MAGIC, seal: bool = True, nblocks: int = _NBLOCKS) -> int:
    """A segment built by hand: a valid layout, but maybe a wrong magic, header or no seals."""
    size = Segment._size(_NBLOCKS, 0, _NUMEL)
    fd = os.memfd_create("cgxps-fake", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as m:
        m[:64] = np.array([magic, os.getpid(), 0, 1, nblocks, 0, _NUMEL, 0], dtype=np.int64).tobytes()
    if seal:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _regular_file() -> int:
    fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, Segment._size(_NBLOCKS, 0, _NUMEL))
    return fd


def _fake_member(name: bytes, rank: int, size: int, make_fd=_good_segment, uid: int | None = None,
                 die_before_hello: bool = False, delay: float = 0) -> int:
    """Child: connect to local rank 0 as ``rank`` and send the segment ``make_fd`` builds.
    Exits 0 if rank 0 replied, 3 if it closed the connection unread (refused)."""
    if uid is not None:
        os.setuid(uid)
    fd = make_fd()
    time.sleep(delay)
    sock = _connect(name)
    if die_before_hello:
        os.kill(os.getpid(), signal.SIGKILL)
    sock.settimeout(10)
    try:
        # rank 0 checks the peer's uid on accept, so a refused peer may find the socket closed
        # before its hello is sent (EPIPE) as well as before the reply (ECONNRESET / EOF)
        sock.sendmsg([_HELLO.pack(_RDV_MAGIC, rank, size)],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        data = sock.recvmsg(64, socket.CMSG_SPACE(4 * size))[0]
    except (ConnectionResetError, BrokenPipeError):
        data = b""
    return 0 if data else 3


def _fake_rank_0(name: bytes) -> int:
    """Child: listen as local rank 0, take one connection, then die by SIGKILL mid-start-up."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(name)
    server.listen(4)
    server.accept()
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


def _squatter(name: bytes, uid: int, ready: int) -> int:
    """Child: another user who bound the rendezvous name first; holds it until killed."""
    os.setuid(uid)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(name)
    server.listen(4)
    os.write(ready, b"x")
    time.sleep(60)
    return 1


def _name_is_free(name: bytes) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        try:
            s.bind(name)
        except OSError:
            return False
        return True


def _reducer(rank: int, job: str, tag: str, timeout: float = 5, size: int = 2) -> NodeReducer:
    return NodeReducer(reduce_worker.layout(), rank, size, 0, job, timeout_s=timeout, run_tag=tag)


# ---- rendezvous -------------------------------------------------------------------------------------------


def test_rendezvous_name_is_abstract_per_user_and_per_run():
    a = rendezvous_name("job", "tag-1", 3)
    assert a.startswith(b"\0cgxps-%d-" % os.getuid()) and a.endswith(b"-n3") and len(a) < 108
    assert a != rendezvous_name("job", "tag-2", 3) != rendezvous_name("job", "tag-1", 4)
    assert rendezvous_name("a\0b", "", 0) != rendezvous_name("a", "b", 0)  # no ambiguous concatenation


@pytest.mark.parametrize("peer, message", [
    (dict(transport="cuda", export=b"{}", host_numel=0), "local rank 1 reduces over cuda but this rank over shm"),
    (dict(nblocks=_NBLOCKS + 1, host_numel=_NUMEL + 5), "do the local ranks build the same model"),
])
def test_a_peer_that_disagrees_is_named(peer, message):
    job, tag = _names()
    fds = _open_fds()
    child = _fork(_fake_member, rendezvous_name(job, tag, 0), 1, 2, lambda: _good_segment(**peer))
    with pytest.raises(IntraNodeError, match=message):
        _reducer(0, job, tag)
    assert _reap(child) == 0
    assert _open_fds() == fds  # the peer's descriptor and the sockets are closed
    assert _shm_files() == set()


@pytest.mark.parametrize("make_fd, message", [
    (lambda: _raw_segment(magic=0x1234), "local rank 1 sent a segment that is not a cgx-ps segment of this version"),
    (lambda: _raw_segment(nblocks=-1), "local rank 1 sent a segment that is not a cgx-ps segment of this version"),
    (lambda: _raw_segment(seal=False), "local rank 1 sent a memfd that is not sealed against resizing"),
    (_regular_file, "local rank 1 sent a descriptor that is not a memfd"),
])
def test_a_foreign_segment_is_refused(make_fd, message):
    """A same-user process sends something that is not our segment: refused before use."""
    job, tag = _names()
    fds = _open_fds()
    child = _fork(_fake_member, rendezvous_name(job, tag, 0), 1, 2, make_fd)
    with pytest.raises(IntraNodeError, match=message):
        _reducer(0, job, tag)
    assert _reap(child) == 0
    assert _open_fds() == fds


def test_a_peer_counting_other_local_ranks_is_named():
    job, tag = _names()
    child = _fork(_fake_member, rendezvous_name(job, tag, 0), 1, 3)
    with pytest.raises(IntraNodeError, match=r"local rank 1 \(pid \d+\) counts 3 local ranks, this rank 2"):
        _reducer(0, job, tag)
    assert _reap(child) == 3  # closed unanswered


def test_a_missing_peer_times_out_with_its_rank():
    job, tag = _names()
    with pytest.raises(IntraNodeError, match=r"local rank 1 did not start within 0.5s"):
        _reducer(0, job, tag, timeout=0.5)
    with pytest.raises(IntraNodeError, match=r"local rank 0 did not start within 0.5s"):
        _reducer(1, job, tag, timeout=0.5)
    assert _shm_files() == set()


@pytest.mark.parametrize("listen", [True, False])
def test_a_squatter_on_the_rendezvous_name_is_named(listen):
    """This process binds rank 0's name first: rank 0 names it instead of waiting forever."""
    job, tag = _names()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as squatter:
        squatter.bind(rendezvous_name(job, tag, 0))
        if listen:
            squatter.listen(4)
        with pytest.raises(IntraNodeError, match=rf"held by uid {os.getuid()} pid {os.getpid()} " if listen else
                           r"held by a process that does not accept connections"):
            _reducer(0, job, tag)


@root
def test_another_users_squatter_gets_nothing():
    job, tag = _names()
    name = rendezvous_name(job, tag, 0)
    ready_r, ready_w = os.pipe()
    child = _fork(_squatter, name, NOBODY, ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(IntraNodeError, match=rf"held by uid {NOBODY} pid {child} \(another user\)"):
            _reducer(0, job, tag)
        fds = _open_fds()
        with pytest.raises(IntraNodeError, match=rf"held by uid {NOBODY} pid {child}, another user: refused"):
            _reducer(1, job, tag)
        assert _open_fds() == fds
    finally:
        os.kill(child, signal.SIGKILL)
        _reap(child)
        os.close(ready_r)
        os.close(ready_w)
    assert _name_is_free(name)  # nothing outlives the squatter's kill -9


@root
def test_another_users_peer_is_refused():
    """A process of uid nobody connects with a well-formed segment: rank 0 drops it unread,
    sums nothing, and names it when the real peer never comes."""
    job, tag = _names()
    child = _fork(_fake_member, rendezvous_name(job, tag, 0), 1, 2, _good_segment, NOBODY)
    with pytest.raises(IntraNodeError, match=rf"local rank 1 did not start within 1s; refused connections "
                                             rf"from other users: uid {NOBODY} \(pid {child}\)"):
        _reducer(0, job, tag, timeout=1)
    assert _reap(child) == 3  # closed without a reply: it got no segment either


@root
def test_another_users_peer_does_not_stop_the_node(tmp_path):
    """Refusing a foreign connection does not fail the start-up: the real rank 1 that connects
    afterwards reduces with rank 0 exactly (the foreign segment summed nothing)."""
    job, tag = _names()
    rank0 = _worker(0, 2, job, tag, tmp_path / "0.pt", steps=2, timeout=20)
    child = _fork(_fake_member, rendezvous_name(job, tag, 0), 1, 2, _good_segment, NOBODY)
    assert _reap(child) == 3  # refused
    rank1 = _worker(1, 2, job, tag, tmp_path / "1.pt", steps=2, timeout=20)
    errs = []
    for r, p in enumerate((rank0, rank1)):
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"local rank {r}:\n{err[-3000:]}"
        errs.append(err)
    assert f"from uid {NOBODY} (pid {child}), another user" in errs[0]
    saved = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    want = expected(2, 2, saved[0]["owners"])
    assert all(torch.equal(g, e) for s in saved for g, e in zip(s["results"], want))


# ---- kill -9 at every stage: nothing left behind, no descriptors leaked, the survivor fails fast --------


def test_a_member_killed_during_start_up_fails_rank_0():
    """Of three local ranks, rank 1 has sent its segment, rank 2 is killed -9 between connect
    and hello: rank 0 fails at once naming it, and closes rank 1's descriptor too."""
    job, tag = _names()
    name = rendezvous_name(job, tag, 0)
    fds = _open_fds()
    good = _fork(_fake_member, name, 1, 3)
    dying = _fork(_fake_member, name, 2, 3, _good_segment, None, True, 0.5)  # connects after rank 1
    t0 = time.monotonic()
    with pytest.raises(IntraNodeError, match=rf"a local rank \(pid {dying}\) closed the connection during start-up"):
        _reducer(0, job, tag, timeout=5, size=3)
    assert time.monotonic() - t0 < 5
    assert _reap(dying) == -signal.SIGKILL and _reap(good) == 3
    assert _open_fds() == fds
    assert _shm_files() == set()
    assert _name_is_free(name)


def test_received_descriptors_are_close_on_exec():
    """A fork+exec on another thread (a data loader, a compiler) must not inherit a segment
    while it is being mapped."""
    from cgx_ps.worker.intranode.rendezvous import _receive

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        r, w = os.pipe()
        os.set_inheritable(r, True)
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
        _, [got] = _receive(b, time.monotonic() + 5, 1, "test", 5)
        assert not os.get_inheritable(got)
        for fd in (r, w, got):
            os.close(fd)


def test_rank_0_killed_during_start_up_fails_the_member():
    job, tag = _names()
    name = rendezvous_name(job, tag, 0)
    fds = _open_fds()
    child = _fork(_fake_rank_0, name)
    with pytest.raises(IntraNodeError, match=rf"local rank 0 \(pid {child}\) closed the connection during start-up"):
        _reducer(1, job, tag, timeout=5)
    assert _reap(child) == -signal.SIGKILL
    assert _open_fds() == fds
    assert _shm_files() == set()
    assert _name_is_free(name)  # a restarted job can listen again at once


def _connections(name: bytes) -> int:
    """Sockets bound to the abstract ``name``: the listener and the connections it accepts."""
    return open("/proc/net/unix").read().split().count("@" + name[1:].decode())


def test_real_rank_0_killed_during_start_up(tmp_path):
    """Two real ranks of three: kill -9 rank 0 once rank 1 has connected and waits for the
    segments; rank 1 fails at once, naming it, and nothing is left."""
    job, tag = _names()
    name = rendezvous_name(job, tag, 0)
    rank0 = _worker(0, 3, job, tag, tmp_path / "0.pt", timeout=10)
    rank1 = _worker(1, 3, job, tag, tmp_path / "1.pt", timeout=10)
    deadline = time.monotonic() + 30
    while _connections(name) < 2:
        assert time.monotonic() < deadline and rank0.poll() is None and rank1.poll() is None
        time.sleep(0.02)
    rank0.kill()
    rank0.wait()
    _, err = rank1.communicate(timeout=10)
    assert rank1.returncode != 0 and f"IntraNodeError: local rank 0 (pid {rank0.pid}) closed the connection" in err
    assert _shm_files() == set()
    assert _name_is_free(name)


def test_real_member_killed_after_start_up(tmp_path):
    """This process is rank 0, a real rank 1 is killed -9 once both are set up: waiting on it
    fails within the timeout naming it; no descriptor of the start-up is left open here."""
    job, tag = _names()
    rank1 = _worker(1, 2, job, tag, tmp_path / "1.pt", steps=1, timeout=10)
    gc.collect()  # descriptors of earlier tests' garbage (channels, pipes) must not close in between
    before = _descriptors()
    try:
        reducer = _reducer(0, job, tag, timeout=10)
        # by (number, target): a number freed by another test's garbage may be reused meanwhile
        new = {fd: what for fd, what in _descriptors().items() if before.get(fd) != what}
        # no socket; only the two mappings' own (close-on-exec) duplicates of the memfds
        assert sorted(new.values()) == ["/memfd:cgxps-n0-r0 (deleted)", "/memfd:cgxps-n0-r1 (deleted)"], new
        assert not any(os.get_inheritable(fd) for fd in new)
        assert rank1.stdout.readline() == "ready\n"
        rank1.kill()
        rank1.wait()
        theirs = reducer.owners.index(1)
        t0 = time.monotonic()
        with pytest.raises(IntraNodeError, match=rf"local rank 1 \(pid {rank1.pid}\) exited while waiting for "
                                                 rf"block {theirs}: result from its owner"):
            asyncio.run(reducer.fetch(theirs, 1))
        assert time.monotonic() - t0 < 10
        reducer.close()
        del reducer
        gc.collect()
        left = {fd: what for fd, what in _descriptors().items() if before.get(fd) != what}
        assert not any("cgxps" in what for what in left.values()), left  # the mappings went with the reducer
    finally:
        rank1.kill()
        rank1.communicate()
    assert _shm_files() == set()


# ---- CUDA IPC (skipped without a GPU) ----------------------------------------------------------------


@gpu
@pytest.mark.parametrize("device", ["cuda:0", pytest.param("cuda:{rank}", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))])
def test_cuda_ipc_matches_shared_memory(tmp_path, device):
    """Two processes (on one GPU, or one GPU each) reduce through CUDA IPC, bit-identical to
    the shared-memory path; their buffers sit inside larger allocations (offset > 0)."""
    on_gpu = run_node(tmp_path, 2, device=device)
    on_host = run_node(tmp_path, 2)
    assert [s["transport"] for s in on_gpu] == ["cuda", "cuda"]
    assert all(s["offset_bytes"] > 0 for s in on_gpu), [s["offset_bytes"] for s in on_gpu]
    want = expected(2, 3, on_gpu[0]["owners"])
    for r in range(2):
        for step in range(3):
            assert torch.equal(on_gpu[r]["results"][step], on_host[r]["results"][step]), (r, step)
            assert torch.equal(on_gpu[r]["results"][step], want[step]), (r, step)
    assert _shm_files() == set()


@gpu
def test_cuda_model_staged_through_host_memory_when_asked(tmp_path):
    saved = run_node(tmp_path, 2, device="cuda:0", transport="shm")
    assert [s["transport"] for s in saved] == ["shm", "shm"]
    want = expected(2, 3, saved[0]["owners"])
    for r in range(2):
        assert all(torch.equal(g, e) for g, e in zip(saved[r]["results"], want))


def test_flags_store_and_load_through_the_fence():
    import numpy as np

    from cgx_ps.worker.intranode.shm_flags import load_acquire, store_release

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
    from cgx_ps.worker.intranode.cuda_ipc import CudaIpcBuffer

    with pytest.raises(IntraNodeError, match=message):
        CudaIpcBuffer.open(record, 2, torch.device("cuda", 0))


def test_a_peers_posted_error_is_raised_as_its_kind_where_it_can_be():
    from cgx_ps.worker.errors import RoundFailedError, ShardUnavailableError
    from cgx_ps.worker.intranode.reduction import relayed_error

    error = relayed_error(1, "ShardUnavailableError", "shard a:1 sent no result")
    assert type(error) is ShardUnavailableError and str(error) == "shard a:1 sent no result (reported by local rank 1)"
    error = relayed_error(0, "RoundFailedError", "round failed on shard a:1: timed out")  # other fields: kept in words
    assert type(error) is IntraNodeError and not isinstance(error, RoundFailedError)
    assert str(error) == "local rank 0 failed: RoundFailedError: round failed on shard a:1: timed out"
    assert type(relayed_error(0, "SystemExit", "x")) is IntraNodeError  # only our own hierarchy's names


def test_a_posted_error_survives_the_segment_round_trip():
    seg, fd = Segment.create(4)
    os.close(fd)
    assert seg.posted_error() is None
    seg.post_error("ShardUnavailableError", "shard a:1 ü" + "x" * 5000)
    seg.post_error("IntraNodeError", "a later error")  # the first one stays
    kind, message = seg.posted_error()
    assert kind == "ShardUnavailableError" and message.startswith("shard a:1 ü") and len(message.encode()) < 1024
