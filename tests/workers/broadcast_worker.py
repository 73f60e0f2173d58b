"""A worker for tests/test_security.py: joins the job, writes its layout for the attacker, then
receives a broadcast from rank 0 and reports what happened as JSON on stdout."""

from __future__ import annotations

import argparse
import json

import torch

import cgx_ps.worker as cgx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout-out", required=True)
    args = p.parse_args()
    cgx.init()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    with open(args.layout_out + ".tmp", "wb") as f:
        f.write(opt.layout.SerializeToString())
    import os
    os.replace(args.layout_out + ".tmp", args.layout_out)  # the attacker never reads half a file
    try:
        cgx.broadcast_parameters(model.state_dict(), root_rank=0)
        outcome = {"ok": True}
    except cgx.CgxPsError as exc:
        outcome = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
    print(json.dumps(outcome), flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
