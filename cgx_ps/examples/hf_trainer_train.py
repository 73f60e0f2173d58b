"""Hugging Face ``Trainer`` with cgx-ps as DDP's communication hook.

Trainer wraps the model in DDP (through Accelerate) at the start of ``train()`` and keeps the
wrapper in ``trainer.model_wrapped``; the callback below registers the cgx-ps hook on it in
``on_train_begin``, which runs after the wrap and before the first backward. A callback works
with any Trainer subclass (TRL's SFTTrainer, ...). The model is a small BERT classifier built
from a config (no download) on a synthetic task: the first token decides the label.

    CGX_PS_SERVERS=127.0.0.1:7070,127.0.0.1:7071 CGX_PS_TOKEN_FILE=... HF_HUB_OFFLINE=1 \\
        torchrun --standalone --nproc-per-node=2 -m cgx_ps.examples.hf_trainer_train --compression 4bit

The lines marked "cgx" are all that the hook adds to a Trainer script.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainerControl,
                          TrainerState, TrainingArguments)

import cgx_ps.worker as cgx
from cgx_ps.examples.ddp_train import hook_report, replica_fingerprint


class CgxCommHook(TrainerCallback):
    """Sends the gradients of ``trainer``'s DDP model through cgx-ps; ``options`` are those of
    ``cgx.DDPHookState`` (compression, warmup_steps, error_feedback, ...)."""

    def __init__(self, trainer: Trainer, **options: object) -> None:
        self.trainer, self.options = trainer, options
        self.state: cgx.DDPHookState | None = None
        self._hooked: DistributedDataParallel | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: object) -> None:
        ddp = self.trainer.model_wrapped
        if ddp is self._hooked:
            return  # train() again: Trainer reuses its DDP model, which keeps the hook
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"CgxCommHook needs a distributed run (torchrun); the model is a {type(ddp).__name__}")
        self.state = cgx.DDPHookState(ddp, **self.options)
        ddp.register_comm_hook(self.state, cgx.ddp_comm_hook)
        self._hooked = ddp


class FirstTokenTask(torch.utils.data.Dataset):
    """Random token sequences; the label says whether the first token is in the vocabulary's lower half."""

    def __init__(self, size: int, vocab: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, vocab, (size, length), generator=g)
        self.labels = (self.input_ids[:, 0] < vocab // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--compression", default="4bit", help="fp32, fp16, bf16, Nbit (N in 1..8)")
    p.add_argument("--warmup-steps", type=int, default=0, help="first steps uncompressed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--json", action="store_true", help="print a JSON summary line")
    return p


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    cgx.init()                                                             # cgx
    vocab = 128
    config = BertConfig(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=2, intermediate_size=2 * args.hidden, max_position_embeddings=32,
                        num_labels=2)
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory(prefix="cgx-ps-hf-") as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, seed=args.seed, use_cpu=not torch.cuda.is_available(),
            ddp_backend=None if torch.cuda.is_available() else "gloo",
            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args,
                          train_dataset=FirstTokenTask(2048, vocab, 16, args.seed))
        hook = CgxCommHook(trainer, compression=args.compression, warmup_steps=args.warmup_steps)  # cgx
        trainer.add_callback(hook)                                         # cgx
        result = trainer.train()

    rank = trainer.args.process_index
    summary = {"event": "done", "rank": rank, "train_loss": result.training_loss, "steps": result.global_step,
               **replica_fingerprint(trainer.model), **hook_report(hook.state)}
    print(json.dumps(summary) if args.json else f"rank {rank}: training loss {result.training_loss:.3f} after "
          f"{result.global_step} steps", flush=True)
    cgx.shutdown()                                                         # cgx


if __name__ == "__main__":
    from cgx_ps.examples import run

    run(main)  # a cgx-ps error in one line, Ctrl-C quietly
