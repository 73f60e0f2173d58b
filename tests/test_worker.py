"""Two shards and several real worker processes on localhost: exact aggregates, identical
replicas, real training, and the failures a user must be told about clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import pytest
import torch

from cgx_ps.kernels import dequantize, encode
from cgx_ps.model_layout import codec_of
from cgx_ps.server.rounds.aggregator import result_seed
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker import ConfigError, WorkerConfig
from cgx_ps.worker.pipeline.codec_threads import plan_threads
from support import env_for, plane_env
from workers.step_worker import rank_gradient
from workers.warm_start import start_worker, run_worker

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


CLUSTER_SETTINGS = dict(shards=2, round_timeout=8)  # the tests' shared shards per plane (conftest.clusters)


def run_workers(script: Path, world: int, servers: list[str], args_for, timeout: float = 240,
                env_extra: dict | None = None) -> list[subprocess.CompletedProcess]:
    job = {"CGX_PS_JOB_ID": f"test-{uuid.uuid4().hex[:8]}", **(env_extra or {})}
    procs = [start_worker([sys.executable, str(script), *args_for(r)], env=env_for(r, world, servers, **job),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def expected_params(saved: dict, world: int, steps: int, accumulate: int, dtype: torch.dtype,
                    local: int = 1, error_feedback: bool = False) -> dict[str, torch.Tensor]:
    """Replay the steps with the reference codec: what every replica must hold afterwards.
    With local > 1, ranks n*local..n*local+local-1 form node n and sum before pushing (for
    local = 2 that float32 sum does not depend on the order)."""
    layout = ps_pb2.Layout.FromString(saved["layout"])
    params = {n: t.clone() for n, t in saved["initial"].items()}
    residuals: dict[tuple[int, int], torch.Tensor] = {}  # (node, block) -> what earlier pushes left out
    for step in range(steps):
        grads = []
        for r in range(world):
            g = {}
            for name, p in params.items():
                acc = rank_gradient(name, p, r, step, 0)
                for part in range(1, accumulate):
                    acc = acc + rank_gradient(name, p, r, step, part)
                g[name] = acc
            grads.append(g)
        avg = {n: torch.empty(p.numel(), dtype=torch.float32) for n, p in params.items()}
        for block in layout.blocks:
            s = block.codec
            decoded = []
            for node in range(world // local):
                buf = None
                for r in range(node * local, (node + 1) * local):
                    part = torch.cat([grads[r][layout.tensors[seg.tensor_index].name].reshape(-1)
                                      [seg.offset:seg.offset + seg.numel].float() for seg in block.segments])
                    buf = part if buf is None else buf + part
                seed = zlib.crc32(f"{node}/{block.block_id}/{step}".encode())
                ef = error_feedback and s.codec == ps_pb2.CODEC_MAXMIN
                if ef:
                    buf = buf + residuals.get((node, block.block_id), torch.zeros_like(buf))
                payload = encode(buf, codec_of(s), bits=s.bits or 4, bucket_size=s.bucket_size or 1024,
                                 stochastic=s.stochastic, seed=seed, impl="reference").to_bytes()
                decoded.append(dequantize(payload, impl="reference"))
                if ef:
                    residuals[(node, block.block_id)] = buf - decoded[-1]
            total = decoded[0]
            for d in decoded[1:]:
                total = total + d
            result = encode(total, codec_of(s), bits=s.bits or 4, bucket_size=s.bucket_size or 1024,
                            stochastic=s.stochastic, seed=result_seed(block.block_id, step), impl="reference")
            mean = dequantize(result.to_bytes(), impl="reference") * (1.0 / world)
            at = 0
            for seg in block.segments:
                name = layout.tensors[seg.tensor_index].name
                avg[name][seg.offset:seg.offset + seg.numel] = mean[at:at + seg.numel]
                at += seg.numel
        for name, p in params.items():
            p.add_(avg[name].view(p.shape).to(dtype), alpha=-1.0)  # SGD, lr 1
    return params


@pytest.mark.parametrize("compression, dtype, accumulate, steps, plane", [
    ("4bit", "float32", 1, 3, "grpc"),
    ("4bit", "float32", 1, 3, "raw"),  # the same pushes and results over the raw data plane
    ("2bit+ef", "float32", 1, 3, "grpc"),  # worker-side error feedback
    ("2bit", "float32", 2, 2, "grpc"),   # gradient accumulation over two backward passes
    ("fp32", "float32", 1, 2, "grpc"),
    ("4bit", "float16", 1, 2, "grpc"),   # half-precision gradients
    ("8bit", "bfloat16", 1, 1, "grpc"),
])
def test_update_matches_reference_and_replicas_identical(clusters, tmp_path, compression, dtype, accumulate, steps,
                                                         plane):
    cluster, world = clusters[plane], 2
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    ef = compression.endswith("+ef")
    compression = compression.removesuffix("+ef")
    results = run_workers(ROOT / "tests/workers/step_worker.py", world, cluster.addresses,
                          lambda r: ["--compression", compression, "--dtype", dtype, "--steps", str(steps),
                                     "--accumulate", str(accumulate), "--out", str(outs[r]),
                                     *(["--error-feedback"] if ef else [])], env_extra=plane_env(plane))
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stderr[-3000:]}"
    saved = [torch.load(o, weights_only=False) for o in outs]
    layout = ps_pb2.Layout.FromString(saved[0]["layout"])
    assert len(layout.blocks) > 2 and {b.shard for b in layout.blocks} == {0, 1}  # both shards used
    for name in saved[0]["final"]:
        assert torch.equal(saved[0]["initial"][name], saved[1]["initial"][name])  # broadcast worked
        assert torch.equal(saved[0]["final"][name], saved[1]["final"][name]), name  # bit-identical
    expected = expected_params(saved[0], world, steps, accumulate, getattr(torch, dtype), error_feedback=ef)
    for name, value in expected.items():
        assert torch.equal(saved[0]["final"][name], value), name  # exact, against the reference codec
    stats = saved[0]["stats"]
    # codec threads sized for this host: 1 torch thread per worker (OMP_NUM_THREADS), both shards local
    cpus = len(os.sched_getaffinity(0))
    plan = plan_threads(cpus, torch_threads=1, local_ranks=1, local_shards=2)
    assert saved[0]["codec_threads"] == (plan.codec_workers, plan.kernel_threads)
    # slices of one float32 .grad are encoded from it and decoded into it; fp16/bf16 are upcast copies
    assert (stats["in_place_blocks"] > 0) is (dtype == "float32"), stats
    if compression == "4bit":
        assert stats["fp32_bytes"] / stats["bytes_pushed"] > 5


def run_example(cluster, world: int, compression: str, epochs: int) -> list[dict]:
    results = run_workers(ROOT / "cgx_ps/examples/train.py", world, cluster.addresses,
                          lambda r: ["--compression", compression, "--epochs", str(epochs), "--json"])
    summaries = []
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stderr[-3000:]}"
        lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        summaries.append(lines)
    return summaries


def test_training_converges_identically_and_4bit_matches_fp32_accuracy(cluster):
    runs = {c: run_example(cluster, 2, c, epochs=6) for c in ("fp32", "4bit")}
    for compression, per_rank in runs.items():
        steps = [e for e in per_rank[0] if e["event"] == "step"]
        first, last = sum(e["loss"] for e in steps[:10]) / 10, sum(e["loss"] for e in steps[-10:]) / 10
        assert last < 0.3 * first, (compression, first, last)  # loss decreases
        done = [next(e for e in lines if e["event"] == "done") for lines in per_rank]
        assert done[0]["param_sha256"] == done[1]["param_sha256"]  # replicas bit-identical
    acc = {c: next(e for e in runs[c][0] if e["event"] == "done")["accuracy"] for c in runs}
    assert acc["fp32"] > 0.9
    assert acc["4bit"] >= acc["fp32"] - 0.01, acc
    done4 = next(e for e in runs["4bit"][0] if e["event"] == "done")
    assert done4["fp32_bytes"] / done4["bytes_pushed"] > 6


def test_mismatched_model_refused_and_peer_fails_clearly(tmp_path, local_cluster):
    c = local_cluster(1, round_timeout=3)
    results = run_workers(ROOT / "tests/workers/step_worker.py", 2, c.addresses,
                          lambda r: ["--hidden", "300" if r == 0 else "200", "--out", str(tmp_path / f"{r}.pt")],
                          timeout=120)
    assert all(r.returncode != 0 for r in results)
    # whichever registered second is refused, naming the tensor; the first is told it is alone
    refused = [r for r in results if "declares a different model layout than the session's: tensor '0.bias'" in r.stderr]
    assert len(refused) == 1, [r.stderr[-500:] for r in results]
    assert "shape [300] expected, got [200]" in refused[0].stderr or "shape [200] expected, got [300]" in refused[0].stderr
    other = results[1 - results.index(refused[0])]
    assert "was not put within 3s" in other.stderr or "waiting for node(s)" in other.stderr, other.stderr[-800:]


def test_a_node_started_alone_says_whom_it_waits_for_and_names_them_when_it_gives_up(tmp_path, local_cluster):
    """Node 1 of 2 restarted alone used to wait in silence, then blame
    the root's broadcast ("was not put within ... did the root rank fail"). Node 0 never joined."""
    c = local_cluster(1, round_timeout=3)
    env = env_for(1, 2, c.addresses, CGX_PS_JOB_ID=f"test-{uuid.uuid4().hex[:8]}")
    alone = run_worker([sys.executable, str(ROOT / "tests/workers/step_worker.py"), "--out",
                        str(tmp_path / "1.pt")], env=env, capture_output=True, text=True, timeout=120)
    assert alone.returncode != 0
    assert "waiting for blob 'broadcast/0': 1 of 2 nodes have joined shard" in alone.stderr, alone.stderr[-800:]
    assert "not yet: node-0" in alone.stderr
    assert "BroadcastError" in alone.stderr and "node(s) never joined the job: node-0 (1 of 2 nodes registered" \
        in alone.stderr, alone.stderr[-800:]


def test_absent_nodes_are_named_when_the_shard_count_allows_it():
    from cgx_ps.worker.broadcast.joining import absent_nodes

    assert absent_nodes(2, 2, 1) == ""
    assert absent_nodes(3, 1, 1) == "node-0, node-2"  # only we registered: every other node is absent
    assert absent_nodes(4, 2, 0) == "2 of the other 3 nodes"  # a count cannot say which


def test_unreachable_shard_gives_a_clear_error(tmp_path):
    results = run_workers(ROOT / "tests/workers/step_worker.py", 1, ["127.0.0.1:9"],
                          lambda r: ["--out", str(tmp_path / "x.pt")], timeout=60,
                          env_extra={"CGX_PS_CONNECT_TIMEOUT": "1.5"})
    assert results[0].returncode != 0
    assert "ShardUnavailableError: shard 127.0.0.1:9 unreachable for 1.5s" in results[0].stderr
    # while it waits it says so, once here (then every 15 s): a silent wait looks like a hang
    assert results[0].stderr.count("shard 127.0.0.1:9 not reachable yet (UNAVAILABLE") == 1, results[0].stderr
    assert "(CGX_PS_CONNECT_TIMEOUT)" in results[0].stderr


# ---- configuration from the environment -------------------------------------------------------------


def test_config_from_torchrun_env():
    c = WorkerConfig.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                               "GROUP_RANK": "1", "CGX_PS_SERVERS": "a:1, b:2"})
    assert (c.rank, c.world_size, c.node_rank, c.num_nodes, c.servers) == (5, 8, 1, 2, ("a:1", "b:2"))
    assert c.codec_threads == 0  # sized for the host (threads.plan_threads)
    assert WorkerConfig.from_env({"CGX_PS_SERVERS": "a:1", "CGX_PS_CODEC_THREADS": "3"}).codec_threads == 3


def test_config_standalone_per_node_with_template():
    c = WorkerConfig.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                               "CGX_PS_NODE_RANK": "3", "CGX_PS_NUM_NODES": "4",
                               "CGX_PS_SERVERS": "shard-{i}.svc:7070", "CGX_PS_NUM_SHARDS": "3"})
    assert (c.rank, c.world_size, c.node_rank, c.num_nodes) == (7, 8, 3, 4)
    assert c.servers == ("shard-0.svc:7070", "shard-1.svc:7070", "shard-2.svc:7070")


@pytest.mark.parametrize("env, message", [
    ({}, "set CGX_PS_SERVERS"),
    ({"CGX_PS_SERVERS": "nohostport"}, "is not host:port"),
    ({"CGX_PS_SERVERS": "s-{i}:1"}, "set CGX_PS_NUM_SHARDS"),
    ({"CGX_PS_SERVERS": "a:1,b:2", "CGX_PS_NUM_SHARDS": "3"}, "lists 2 shards but CGX_PS_NUM_SHARDS=3"),
    ({"CGX_PS_SERVERS": "a:1", "RANK": "x"}, "RANK='x': must be an integer in 0.."),
    ({"CGX_PS_SERVERS": "a:1", "RANK": "4", "WORLD_SIZE": "2"}, "RANK=4 is not in 0..WORLD_SIZE-1=1"),
    ({"CGX_PS_SERVERS": "a:1", "CGX_PS_CODEC_THREADS": "-1"}, "CGX_PS_CODEC_THREADS='-1': must be an integer in 0..256"),
    ({"CGX_PS_SERVERS": "a:1", "CGX_PS_DATAPLANE": "quic"}, "CGX_PS_DATAPLANE='quic' is not one of auto, grpc, raw"),
])
def test_config_errors_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WorkerConfig.from_env(env)


# ---- intra-node reduction: two nodes of two local ranks ------------------------------------------------


def _shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("cgxps-*")} if Path("/dev/shm").is_dir() else set()


def run_nodes(cluster, nodes: int, local: int, args_for, timeout: float = 240, env_extra=None):
    job = f"test-{uuid.uuid4().hex[:8]}"
    procs = []
    for node in range(nodes):
        for lr in range(local):
            rank = node * local + lr
            env = dict(os.environ, LOCAL_RANK=str(lr), LOCAL_WORLD_SIZE=str(local), RANK=str(lr),
                       WORLD_SIZE=str(local), CGX_PS_NODE_RANK=str(node), CGX_PS_NUM_NODES=str(nodes),
                       CGX_PS_SERVERS=",".join(cluster.addresses), CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1",
                       CGX_PS_CONNECT_TIMEOUT="20", **(env_extra or {}))
            procs.append(start_worker([sys.executable, str(ROOT / "tests/workers/step_worker.py"), *args_for(rank)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def _pushes(metrics_port: int) -> dict[str, float]:
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("cgx_ps_pushes_total{") and 'outcome="accepted"' in line:
            node = line.split('node="')[1].split('"')[0]
            out[node] = float(line.split()[-1])
    return out


def test_two_nodes_of_two_ranks_reduce_locally_and_push_once(tmp_path, local_cluster):
    before = _shm_files()
    steps = 3
    c = local_cluster(2, round_timeout=20, metrics_base_port=0)
    outs = [tmp_path / f"rank{r}.pt" for r in range(4)]
    results = run_nodes(c, 2, 2, lambda r: ["--compression", "4bit", "--steps", str(steps), "--out", str(outs[r])])
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stderr[-3000:]}"
    pushes = [_pushes(port) for port in c.metrics_ports]
    saved = [torch.load(o, weights_only=False) for o in outs]
    layout = ps_pb2.Layout.FromString(saved[0]["layout"])
    for r in range(1, 4):
        for name in saved[0]["final"]:
            assert torch.equal(saved[0]["final"][name], saved[r]["final"][name]), (r, name)
    expected = expected_params(saved[0], 4, steps, 1, torch.float32, local=2)
    for name, value in expected.items():
        assert torch.equal(saved[0]["final"][name], value), name
    # the shards count nodes: exactly one push per block per node per round, whatever the ranks
    for shard, counts in enumerate(pushes):
        owned = sum(1 for b in layout.blocks if b.shard == shard)
        assert counts == {"node-0": owned * steps, "node-1": owned * steps}, (shard, counts)
    # both local ranks of a node pushed (reduce-scatter: the compression work is shared)
    pushed_bytes = [s["stats"]["bytes_pushed"] for s in saved]
    assert all(b > 0 for b in pushed_bytes), pushed_bytes
    assert _shm_files() == before  # nothing left in /dev/shm


def _gpu_codec_ready() -> bool:
    import importlib.util
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


@pytest.mark.skipif(not _gpu_codec_ready(), reason="needs a CUDA GPU and CuPy")
def test_two_nodes_of_two_gpu_ranks_reduce_over_cuda_ipc(tmp_path, local_cluster):
    """Four processes on one GPU: each node's two ranks reduce through CUDA IPC, compress on the
    GPU, and end bit-identical to the CPU replay of the same steps."""
    before = _shm_files()
    steps = 3
    c = local_cluster(2, round_timeout=30)
    outs = [tmp_path / f"rank{r}.pt" for r in range(4)]
    results = run_nodes(c, 2, 2, lambda r: ["--steps", str(steps), "--out", str(outs[r]), "--device", "cuda"])
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stderr[-3000:]}"
    saved = [torch.load(o, weights_only=False) for o in outs]
    assert [s["intranode"] for s in saved] == ["cuda"] * 4
    expected = expected_params(saved[0], 4, steps, 1, torch.float32, local=2)
    for r in range(4):
        for name, value in expected.items():
            assert torch.equal(saved[r]["final"][name], value), (r, name)
    assert _shm_files() == before


def test_stalled_local_rank_fails_its_node_within_the_timeout(tmp_path, local_cluster):
    """A local rank that hangs (SIGSTOP: alive, holding its segment) must not hang the node: the
    other rank fails, naming what it waited for: within the round timeout when it waited for the
    stalled rank's gradient, OWNER_GIVES_UP_S later when for its result (a live owner would have
    named a silent shard by then, intranode.py)."""
    from cgx_ps.worker.intranode.reduction import OWNER_GIVES_UP_S
    import signal
    import time

    before = _shm_files()
    job = f"test-{uuid.uuid4().hex[:8]}"
    c = local_cluster(1, round_timeout=5)
    procs = []
    for lr in range(2):
        env = dict(os.environ, LOCAL_RANK=str(lr), LOCAL_WORLD_SIZE="2", RANK=str(lr), WORLD_SIZE="2",
                   CGX_PS_NODE_RANK="0", CGX_PS_NUM_NODES="1", CGX_PS_SERVERS=c.addresses[0],
                   CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1", CGX_PS_CONNECT_TIMEOUT="20")
        args = ["--steps", "3", "--out", str(tmp_path / f"{lr}.pt"), *(["--stall-at-step", "1"] if lr else [])]
        procs.append(start_worker([sys.executable, str(ROOT / "tests/workers/step_worker.py"), *args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    stalled, survivor = procs[1], procs[0]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until rank 1 has stopped itself
            with open(f"/proc/{stalled.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.05)
        else:
            pytest.fail("rank 1 never reached its stall point")
        t0 = time.monotonic()
        _, err = survivor.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        stalled.send_signal(signal.SIGKILL)
        stalled.communicate(timeout=30)
    assert survivor.returncode != 0
    waited = "5s waiting for block" if "gradient (local rank" in err else f"{5 + OWNER_GIVES_UP_S:g}s waiting for block"
    assert f"IntraNodeError: timed out after {waited}" in err and "(local rank 1 stalled?)" in err, err[-1500:]
    assert elapsed < 5 + OWNER_GIVES_UP_S + 20, elapsed  # the timeout plus start-up slack, not forever
    assert _shm_files() == before


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _gpu_codec_ready(), reason="needs a CUDA GPU and CuPy"))])
def test_dead_local_rank_fails_its_node_clearly(tmp_path, device, local_cluster):
    before = _shm_files()
    c = local_cluster(1, round_timeout=10)
    results = run_nodes(c, 1, 2, lambda r: ["--steps", "2", "--out", str(tmp_path / f"{r}.pt"),
                                            "--device", device,
                                            *(["--die-at-step", "1"] if r == 1 else [])], timeout=120)
    assert results[1].returncode == 3
    assert results[0].returncode != 0
    assert "IntraNodeError: local rank 1 (pid" in results[0].stderr and "exited while waiting" in results[0].stderr, \
        results[0].stderr[-1500:]
    assert _shm_files() == before
