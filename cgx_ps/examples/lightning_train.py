"""PyTorch Lightning with cgx-ps as DDP's communication hook.

Lightning wraps the LightningModule in DDP inside ``trainer.fit``; the callback below registers
the cgx-ps hook on that DDP model in ``on_fit_start``, which runs after the wrap and before the
first backward, on every device. (``DDPStrategy(ddp_comm_hook=cgx.ddp_comm_hook,
ddp_comm_state=cgx.DDPHookState(module, ...))`` does the same on GPUs, but Lightning 2.x passes
those two arguments to DDP only when the device is CUDA and silently drops them on CPU; DDP takes
one hook, so use one way or the other.) The task and flags are those of ``cgx_ps.examples.train``:

    CGX_PS_SERVERS=127.0.0.1:7070,127.0.0.1:7071 CGX_PS_TOKEN_FILE=... \\
        torchrun --standalone --nproc-per-node=2 -m cgx_ps.examples.lightning_train --compression 4bit

Lightning reads the torchrun environment (one process per device, ``devices`` =
LOCAL_WORLD_SIZE, ``num_nodes`` = WORLD_SIZE / LOCAL_WORLD_SIZE).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import cgx_ps.worker as cgx
from cgx_ps.examples.ddp_train import hook_report, replica_fingerprint
from cgx_ps.examples.train import build_parser, load_data

try:  # the `lightning` package, or the standalone `pytorch-lightning`
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy


class CgxCommHook(pl.Callback):
    """Sends the gradients of Lightning's DDP model through cgx-ps; ``options`` are those of
    ``cgx.DDPHookState`` (compression, warmup_steps, error_feedback, ...)."""

    def __init__(self, **options: object) -> None:
        self.options = options
        self.state: cgx.DDPHookState | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"CgxCommHook needs Lightning's DDP strategy; the model is a {type(ddp).__name__}")
        self.state = cgx.DDPHookState(pl_module, **self.options)
        ddp.register_comm_hook(self.state, cgx.ddp_comm_hook)


class DigitsClassifier(pl.LightningModule):
    def __init__(self, hidden: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = build_parser(checkpoints=False)  # no checkpointing in this example yet
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: all epochs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cgx.init()                                                             # cgx
    pl.seed_everything(args.seed, verbose=False)
    x_train, y_train, x_test, y_test = load_data(args.data, args.seed)
    # Lightning puts a DistributedSampler in: each rank trains on its share of every epoch
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = DigitsClassifier(args.hidden, args.lr)
    hook = CgxCommHook(compression=args.compression, warmup_steps=args.warmup_steps,  # cgx
                       error_feedback=args.error_feedback)
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=local,
        num_nodes=world // local,
        strategy=DDPStrategy(process_group_backend=None if torch.cuda.is_available() else "gloo"),
        callbacks=[hook],
        max_epochs=args.epochs, max_steps=args.max_steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)

    with torch.no_grad():
        accuracy = (model(x_test.to(model.device)).argmax(1).cpu() == y_test).float().mean().item()
    summary = {"event": "done", "rank": trainer.global_rank, "accuracy": accuracy, "steps": trainer.global_step,
               **replica_fingerprint(model), **hook_report(hook.state)}
    print(json.dumps(summary) if args.json else f"rank {trainer.global_rank}: accuracy {accuracy:.3f} after "
          f"{trainer.global_step} steps", flush=True)
    cgx.shutdown()                                                         # cgx


if __name__ == "__main__":
    from cgx_ps.examples import run

    run(main)  # a cgx-ps error in one line, Ctrl-C quietly
