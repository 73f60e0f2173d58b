"""Compressed data-parallel training with cgx-ps: the script to copy.

Classifies scikit-learn's bundled handwritten digits (no download) with an MLP; without
scikit-learn, ``--data synthetic`` trains on generated data of the same shape. Run one process per
GPU/CPU worker, for example on each node:

    CGX_PS_SERVERS=host0:7070,host1:7070 CGX_PS_NODE_RANK=0 CGX_PS_NUM_NODES=2 \\
        torchrun --standalone --nproc-per-node=1 -m cgx_ps.examples.train --compression 4bit

or let `cgx-ps demo` start shards and workers on this machine. The lines marked "cgx" are all
that differs from single-process training.

Checkpoint and resume: with ``--checkpoint DIR`` every rank saves its state every
``--checkpoint-every`` steps (a file per rank: error-feedback residuals are each rank's own), and
a restarted job resumes from the newest step all ranks saved, bit for bit. Let torchrun restart
the job when a worker dies (each restart is a new incarnation: the shards drop the old run):

    CGX_PS_SERVERS=host0:7070,host1:7070 CGX_PS_JOB_ID=my-job \
        torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29400 -m cgx_ps.examples.train --error-feedback \
        --checkpoint /checkpoints/my-job --checkpoint-every 50
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import time

import torch
import torch.nn.functional as F

import cgx_ps.worker as cgx


def build_parser(checkpoints: bool = True) -> argparse.ArgumentParser:
    """The flags every example shares; ``checkpoints=False`` for a script that does not save any
    (a flag it would accept and ignore loses a user's progress without a word)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--compression", default="4bit", help="fp32, fp16, bf16, Nbit (N in 1..8)")
    p.add_argument("--warmup-steps", type=int, default=0, help="first steps uncompressed")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--data", choices=["digits", "synthetic"], default="digits",
                   help="digits: scikit-learn's handwritten digits; synthetic: 10 Gaussian classes of the same "
                        "shape, for a machine without scikit-learn (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON line per step (for cgx-ps demo)")
    if not checkpoints:
        return p
    p.add_argument("--checkpoint", metavar="DIR", help="save every rank's state here, and resume from the newest "
                                                       "complete checkpoint found at start")
    p.add_argument("--checkpoint-every", type=int, default=100, metavar="N", help="steps between checkpoints")
    return p


def load_data(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """1797 examples of 64 features in 10 classes, split 1437 / 360 (the same on every rank)."""
    if kind == "digits":
        from sklearn.datasets import load_digits

        data = load_digits()
        x = torch.tensor(data.data, dtype=torch.float32) / 16.0
        y = torch.tensor(data.target)
    else:  # a class is a random centre plus noise: learnable, but not in one step
        g = torch.Generator().manual_seed(1234)
        y = torch.arange(1797) % 10
        x = (torch.rand(10, 64, generator=g)[y] + 0.35 * torch.randn(1797, 64, generator=g)).clamp(0, 1)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def batch_indices(step: int, samples: int, batch_size: int) -> torch.Tensor:
    """The job's step ``step`` in this rank's ``samples``: batch i of epoch e's shuffle, (e, i) =
    divmod(step, steps per epoch). Picked by the step, not drawn in turn, so a node that caught
    up on rounds under a quorum skips their batches and ends at the job's last step."""
    epoch, i = divmod(step, samples // batch_size)
    return _shuffle(epoch, samples)[i * batch_size:(i + 1) * batch_size]


@functools.lru_cache(maxsize=1)  # one epoch's order at a time
def _shuffle(epoch: int, samples: int) -> torch.Tensor:
    return torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    config = cgx.init()                                                    # cgx
    torch.manual_seed(args.seed + config.rank)  # different init per rank: the broadcast fixes it
    x_train, y_train, x_test, y_test = load_data(args.data, args.seed)
    mine = torch.arange(config.rank, len(y_train), config.world_size)      # this rank's shard
    x_train, y_train = x_train[mine], y_train[mine]

    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = cgx.DistributedOptimizer(                                  # cgx
        optimizer, named_parameters=model.named_parameters(), compression=args.compression,
        warmup_steps=args.warmup_steps, error_feedback=args.error_feedback)
    checkpoints = cgx.Checkpoints(args.checkpoint) if args.checkpoint else None   # cgx
    start, saved = checkpoints.load_latest() if checkpoints else (0, None)
    if saved is not None:  # before the first step: the shards resume at the checkpoint's rounds
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])                      # cgx state included
        print(f"rank {config.rank}: resumed from step {start} ({args.checkpoint})", flush=True)
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)              # cgx
    cgx.broadcast_optimizer_state(optimizer, root_rank=0)                  # cgx

    steps_per_epoch = len(y_train) // args.batch_size
    total = args.epochs * steps_per_epoch
    step, pushed, fp32, step_times = start, 0, 0, []
    # Driven by the job's step count, not by the batches: under a quorum (CGX_PS_QUORUM) a node that
    # was late applies the rounds it missed without computing them, and skips their batches
    while step < total:
        t0, epoch = time.perf_counter(), step // steps_per_epoch
        idx = batch_indices(step, len(y_train), args.batch_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        stats = optimizer.stats
        pushed, fp32, step = pushed + stats.bytes_pushed, fp32 + stats.fp32_bytes, optimizer.steps_done   # cgx
        if args.json and config.rank == 0:
            print(json.dumps({"event": "step", "step": step, "epoch": epoch, "loss": loss.item(),
                              "bytes": stats.bytes_pushed, "fp32_bytes": stats.fp32_bytes,
                              "exposed_s": stats.exposed_comm_s, "step_s": step_times[-1],
                              "total_steps": total}), flush=True)
        # a node that caught up past a checkpoint's step never held that step's state: it skips
        # that checkpoint, and a restart resumes from the newest step every rank saved
        if checkpoints is not None and step % args.checkpoint_every == 0:
            checkpoints.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})

    with torch.no_grad():
        logits = model(x_test)
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
        test_loss = F.cross_entropy(logits, y_test).item()
    checksum = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    summary = {"event": "done", "rank": config.rank, "accuracy": accuracy, "test_loss": test_loss,
               "steps": step, "computed_steps": len(step_times), "bytes_pushed": pushed, "fp32_bytes": fp32,
               "param_sha256": checksum,
               "median_step_s": sorted(step_times)[len(step_times) // 2] if step_times else 0.0,
               "resumed_from": start}
    print(json.dumps(summary) if args.json else
          f"rank {config.rank}: accuracy {accuracy:.3f}, test loss {test_loss:.3f}, "
          f"pushed {pushed / 1e6:.1f} MB ({fp32 / max(pushed, 1):.1f}x less than fp32)", flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    from cgx_ps.examples import run

    run(main)  # a cgx-ps error in one line, Ctrl-C quietly
