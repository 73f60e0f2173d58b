"""Hugging Face Accelerate with cgx-ps as DDP's communication hook.

Accelerate wraps the model in DDP inside ``accelerator.prepare``; its own
``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's built-in hooks (an enum:
fp16, bf16, PowerSGD), so the cgx-ps hook is registered on the prepared model, before the first
backward. The task and flags are those of ``cgx_ps.examples.train`` (the digits MLP):

    CGX_PS_SERVERS=127.0.0.1:7070,127.0.0.1:7071 CGX_PS_TOKEN_FILE=... \\
        torchrun --standalone --nproc-per-node=2 -m cgx_ps.examples.accelerate_train --compression 4bit

(``accelerate launch --num_processes 2 -m cgx_ps.examples.accelerate_train`` works as well.)
The lines marked "cgx" are all that the hook adds to an Accelerate script.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import cgx_ps.worker as cgx
from cgx_ps.examples.ddp_train import hook_report, replica_fingerprint
from cgx_ps.examples.train import build_parser, load_data


def main() -> None:
    parser = build_parser(checkpoints=False)  # no checkpointing in this example yet
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cgx.init()                                                             # cgx
    # Without a GPU, Accelerate runs multi-process only when told to use the CPU (gloo).
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.data, args.seed)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # model is now DDP
    state = cgx.DDPHookState(model, compression=args.compression, warmup_steps=args.warmup_steps,  # cgx
                             error_feedback=args.error_feedback)
    model.register_comm_hook(state, cgx.ddp_comm_hook)                     # cgx

    step, total = 0, args.max_steps or args.epochs * len(loader)
    while step < total:
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if args.json and accelerator.is_main_process:
                print(json.dumps({"event": "step", "step": step, "loss": loss.item(), "total_steps": total}),
                      flush=True)
            if step == total:
                break

    net = accelerator.unwrap_model(model)
    with torch.no_grad():
        accuracy = (net(x_test.to(accelerator.device)).argmax(1).cpu() == y_test).float().mean().item()
    summary = {"event": "done", "rank": accelerator.process_index, "accuracy": accuracy, "steps": step,
               **replica_fingerprint(net), **hook_report(state)}
    print(json.dumps(summary) if args.json else f"rank {accelerator.process_index}: accuracy {accuracy:.3f} after "
          f"{step} steps", flush=True)
    accelerator.end_training()
    cgx.shutdown()                                                         # cgx


if __name__ == "__main__":
    from cgx_ps.examples import run

    run(main)  # a cgx-ps error in one line, Ctrl-C quietly
