"""Stock PyTorch DDP with cgx-ps as its communication hook: the script to copy for a DDP codebase.

The task and flags of ``cgx_ps.examples.train`` (the digits MLP), trained by an unchanged DDP
loop: DDP still buckets gradients and overlaps their communication with backward, but each
bucket goes through the cgx-ps shards compressed instead of through an allreduce. One process
per GPU/CPU worker; DDP needs its own process group, which torchrun's rendezvous provides:

    CGX_PS_SERVERS=127.0.0.1:7070,127.0.0.1:7071 CGX_PS_TOKEN_FILE=... \\
        torchrun --standalone --nproc-per-node=2 -m cgx_ps.examples.ddp_train --compression 4bit

``--plain-ddp`` trains the same model with DDP's own allreduce, for comparison. The lines marked
"cgx" are all that the hook adds to a DDP script.

Checkpoint and resume as in ``cgx_ps.examples.train``: with ``--checkpoint DIR`` every rank saves
the model, the optimizer and the hook's state (``state.state_dict()``: step counters and this
rank's error-feedback residuals) every ``--checkpoint-every`` steps, and a restarted job loads the
newest step every rank saved, before the first backward, and goes on bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx_ps.worker as cgx
from cgx_ps.examples.train import batch_indices, build_parser, load_data


def replica_fingerprint(model: torch.nn.Module) -> dict[str, object]:
    """The parameter count and a digest of the parameters: replicas are bit-identical exactly
    when their digests agree."""
    params = [p.detach().cpu() for p in model.parameters()]
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()
    return {"parameters": sum(p.numel() for p in params), "param_sha256": digest}


def hook_report(state: cgx.DDPHookState) -> dict[str, object]:
    """What the hook did: steps it ended, the layout's block count, the last step's bytes."""
    stats = state.stats  # of the last step the hook ended (stats.step counts from 0)
    return {"hook_steps": stats.step + 1, "blocks": len(state.layout.blocks), "bytes_pushed": stats.bytes_pushed,
            "fp32_bytes": stats.fp32_bytes, "exposed_s": stats.exposed_comm_s}


def main() -> None:
    parser = build_parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--plain-ddp", action="store_true", help="DDP's own allreduce, no cgx-ps (for comparison)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = cgx.init()                                                    # cgx
    device = torch.device(f"cuda:{config.local_rank}" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed + config.rank)  # different init per rank: DDP broadcasts rank 0's
    x_train, y_train, x_test, y_test = load_data(args.data, args.seed)
    mine = torch.arange(config.rank, len(y_train), config.world_size)      # this rank's share
    x_train, y_train = x_train[mine].to(device), y_train[mine].to(device)

    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10)).to(device)
    ddp = DDP(model, gradient_as_bucket_view=True)  # .grad is DDP's bucket: fewer copies (README)
    state = None
    if not args.plain_ddp:
        state = cgx.DDPHookState(ddp, compression=args.compression, warmup_steps=args.warmup_steps,  # cgx
                                 error_feedback=args.error_feedback)
        ddp.register_comm_hook(state, cgx.ddp_comm_hook)                   # cgx
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    if state is not None:  # under a quorum, a late node steps it for the rounds it missed
        cgx.catch_up_with(optimizer, hook_state=state)                     # cgx
    checkpoints = cgx.Checkpoints(args.checkpoint) if args.checkpoint else None   # cgx
    start, saved = checkpoints.load_latest() if checkpoints else (0, None)
    if saved is not None:  # before the first backward: the hook resumes at the checkpoint's rounds
        model.load_state_dict(saved["model"])  # the same on every rank: no broadcast needed
        optimizer.load_state_dict(saved["optimizer"])
        if state is not None and "cgx_ps" in saved:  # absent after --plain-ddp: the hook starts fresh
            state.load_state_dict(saved["cgx_ps"])                         # cgx
        print(f"rank {config.rank}: resumed from step {start} ({args.checkpoint})", flush=True)

    steps_per_epoch = len(y_train) // args.batch_size
    total = args.epochs * steps_per_epoch
    total = min(total, args.max_steps) if args.max_steps else total
    step, step_times = start, []
    hook_base = start - (state.steps_done if state is not None else 0)  # start: a --plain-ddp checkpoint
    while step < total:  # by the job's step count (a late node skips the batches it caught up on)
        t0 = time.perf_counter()
        idx = batch_indices(step, len(y_train), args.batch_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
        loss.backward()  # the hook runs here, bucket by bucket, as DDP's allreduce would
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        step = hook_base + state.steps_done if state is not None else step + 1   # cgx
        if args.json and config.rank == 0:
            print(json.dumps({"event": "step", "step": step, "loss": loss.item(), "step_s": step_times[-1],
                              "total_steps": total}), flush=True)
        if checkpoints is not None and step % args.checkpoint_every == 0:
            checkpoints.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    **({"cgx_ps": state.state_dict()} if state else {})})   # cgx

    with torch.no_grad():
        logits = model(x_test.to(device))
        accuracy = (logits.argmax(1) == y_test.to(device)).float().mean().item()
    summary = {"event": "done", "rank": config.rank, "accuracy": accuracy, "steps": step,
               "computed_steps": len(step_times), "resumed_from": start,
               **replica_fingerprint(model), "median_step_s": sorted(step_times)[len(step_times) // 2] if step_times else 0.0,
               **(hook_report(state) if state else {})}
    print(json.dumps(summary) if args.json else f"rank {config.rank}: accuracy {accuracy:.3f} after {step} steps",
          flush=True)
    dist.destroy_process_group()
    cgx.shutdown()                                                         # cgx


if __name__ == "__main__":
    from cgx_ps.examples import run

    run(main)  # a cgx-ps error in one line, Ctrl-C quietly
