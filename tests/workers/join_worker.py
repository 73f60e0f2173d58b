"""A worker for tests/test_uneven.py: a small model trained with DistributedOptimizer for
--epochs epochs of --batches batches on this node (a different number on each node: uneven
inputs), each epoch inside ``cgx.join``; seeded per-node data.

Prints one JSON line: the node's steps (shadow steps included), the batches it computed, a
digest of its final parameters and optimizer state, the seconds its training loop took, and the
errors that bad uses of ``cgx.join`` raised (a nested ``join``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
from quorum_worker import small_job  # this folder: on the path of a script run from it

import cgx_ps.worker as cgx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.02, help="emulated compute per batch (a sleep)")
    args = p.parse_args()
    config, model, opt, data = small_job()
    computed, refusals = 0, []
    started = time.monotonic()
    for epoch in range(args.epochs):
        with cgx.join(opt):
            if epoch == 0:
                try:
                    with cgx.join(opt):
                        pass
                except cgx.CgxPsError as exc:
                    refusals.append(str(exc))
            for _ in range(args.batches):
                x = torch.randn(16, 32, generator=data)
                loss = (model(x) - x[:, :4]).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                time.sleep(args.step_s)
                opt.step()
                computed += 1
    took = time.monotonic() - started
    state = [t for t in model.state_dict().values()] + [s["momentum_buffer"] for s in opt.state.values()]
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in state)).hexdigest()
    print(json.dumps({"node": config.node_rank, "steps": opt.steps_done, "computed": computed,
                      "digest": digest, "train_s": took, "refusals": refusals}), flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
