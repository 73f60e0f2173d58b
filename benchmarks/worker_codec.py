"""A worker's codec-thread work of one step, per code tree, interleaved: each tree's own
``BlockExchange._encode`` and ``_decode`` over a model's blocks, and the framing of each push that
its communication thread then does, as thread CPU (``time.thread_time``).

    .venv/bin/python benchmarks/worker_codec.py [--trees DIR ...] [--rounds 20] [--model mlp17m]
        [--contend]

What ``benchmarks/worker_cpu.py`` cannot resolve on a shared machine (the whole worker varies by
±30 ms between runs), measured without training around it: per round, every block of the layout
(mlp17m: 18 blocks, 4-bit, stochastic, 68 MB) is encoded from its gradient, framed, read back as a
result would be (the tree's ``read_result``: a view of the received message) and decoded, scaled by
1/2, into another 68 MB, as the DDP hook's early hand-over encodes autograd's tensor and decodes
into DDP's bucket. Every block's input was last touched a round (68 MB of other traffic) ago, so
it comes from memory, as a gradient does after backward, not from cache.

``--contend``: a thread of the child streams through 256 MB meanwhile (a copy, as backward's
memory traffic competes with the codec thread in a worker), so the kernels' sensitivity to memory
contention shows; it runs on the other core and is not counted.

Each tree (a directory holding a ``cgx_ps`` package: ``git archive <commit> | tar -x -C DIR``, its
numba cache warmed) runs in a child process of its own (``trees.TreeChildren``), rounds alternated
with the order rotated; this checkout is always the last. Per tree: the median CPU per round of the
encode calls, the framing, the decode calls and their sum, and the paired ratio of the sum to the
first tree's. The trees must write the same bytes: every round's pushed frames and decoded values
are hashed, and the run fails where a tree's digest differs from the first tree's.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def child(model: str, contend: bool) -> None:
    """One tree: answer each line on stdin with one round's "encode_ms frame_ms decode_ms digest"."""
    import torch

    import cgx_ps
    from cgx_ps.net.chunk_frames import PULL_FIELD, PUSH_FIELD, chunk_frames, read_chunk
    from cgx_ps.worker import WorkerConfig
    from cgx_ps.worker.shards import client
    from cgx_ps.worker.pipeline.block_exchange import BlockExchange, BlockState, block_seed
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
    from cgx_ps.worker.frontends.stepstats import CommSpan

    sys.path.insert(1, str(HERE))
    from benchmarks.workload import build_model

    print(cgx_ps.__file__, flush=True)
    torch.set_num_threads(1)
    from cgx_ps.kernels import cpu

    cpu.set_num_threads(1)  # the worker's thread plan on 2 cores: one codec thread, no split
    named = list(build_model(model).named_parameters())
    layout = build_layout([TensorInfo.of(n, p) for n, p in named], 2, Compression())

    class Engine:  # what _encode asks of the engine in trees that frame on the codec thread
        @staticmethod
        def wire_block(block_id: int) -> int:
            return block_id

    config = WorkerConfig(world_size=2, num_nodes=2, servers=("127.0.0.1:9",))  # decode divides by 2
    exchange = BlockExchange(Engine(), None, config, CommSpan(), False)
    gen = torch.Generator().manual_seed(0)
    blocks = []
    for spec in layout.blocks:
        grad, out = torch.randn(spec.numel, generator=gen), torch.empty(spec.numel)
        block = BlockState(spec, out, spec.codec, None, grad, out)
        blocks.append((block, grad))
    frames_on_codec_thread = "round_" in inspect.signature(exchange._encode).parameters
    push_frames = getattr(client, "push_frames", None)
    if contend:
        source, target = torch.empty(1 << 26), torch.empty(1 << 26)  # 256 MB each, outside every cache

        def stream() -> None:
            while True:
                target.copy_(source)

        threading.Thread(target=stream, daemon=True).start()
    r = 0
    for _ in sys.stdin:
        digest = hashlib.sha256()
        spent = [0.0, 0.0, 0.0]
        for block, grad in blocks:
            block.work = grad  # the gradient, as submit() points it (the exchange points it back after)
            seed = block_seed(0, block.spec.block_id, r)
            t0 = time.thread_time()
            if frames_on_codec_thread:
                payload = exchange._encode(block, True, seed, r)
            else:
                payload = exchange._encode(block, True, seed)
            t1 = time.thread_time()
            frames = (push_frames(block.spec.block_id, r, payload) if push_frames is not None
                      else chunk_frames(PUSH_FIELD, block.spec.block_id, r, payload))
            t2 = time.thread_time()
            # the shard's answer, as it arrives: one frame per result up to 1 MiB (the push's bytes here)
            data = b"".join(bytes(read_chunk(f, PUSH_FIELD).data) for f in frames)
            result = client.read_result(chunk_frames(PULL_FIELD, block.spec.block_id, r, data)[0]).data
            t3 = time.thread_time()
            exchange._decode(block, result)
            t4 = time.thread_time()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[2] += t4 - t3
            for frame in frames:
                digest.update(frame)
            digest.update(block.result.numpy().tobytes())
        r += 1
        print(" ".join(f"{s * 1e3:.3f}" for s in spent), digest.hexdigest()[:16], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="*", default=[], help="directories holding a cgx_ps package to compare")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per tree (after two warm-ups)")
    parser.add_argument("--model", default="mlp17m")
    parser.add_argument("--contend", action="store_true", help="stream memory on another thread meanwhile")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from benchmarks.trees import TreeChildren, paired_ratio

    trees = [Path(t).resolve() for t in args.trees] + [HERE]
    argv = [str(Path(__file__).resolve()), "--child", args.model, "1" if args.contend else "0"]
    spent: list[list[list[float]]] = [[] for _ in trees]
    digests: list[list[str]] = [[] for _ in trees]
    load = os.getloadavg()[0]
    with TreeChildren(trees, argv) as children:
        for counted, k, line in children.rounds(args.rounds):
            *ms, digest = line.split()
            if counted:
                spent[k].append([float(v) for v in ms])
                digests[k].append(digest)
    print(f"{args.model}, one step's codec work per round, thread CPU ms, median of {args.rounds} rounds"
          f"{', memory contended' if args.contend else ''}; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("| tree | encode (codec thread) | framing (communication thread) | decode (codec thread) | sum "
          "| × first tree, paired |")
    print("|---|---:|---:|---:|---:|---:|")
    sums = [[sum(row) for row in per_tree] for per_tree in spent]
    for k, tree in enumerate(trees):
        parts = " | ".join(f"{statistics.median(row[i] for row in spent[k]):.2f}" for i in range(3))
        print(f"| {tree} | {parts} | {statistics.median(sums[k]):.2f} | {paired_ratio(sums[k], sums[0]):.3f} |")
    if any(d != digests[0] for d in digests):
        raise SystemExit("the trees wrote different bytes (pushed frames or decoded values differ)")
    print("every tree pushed the same frames and decoded the same values in every round")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3] == "1")
    else:
        main()
