"""Example training scripts, shipped in the package so ``cgx-ps demo`` and
``torchrun -m cgx_ps.examples.train`` work from an installed wheel; copy one to start your own.

    train.py              DistributedOptimizer in a plain loop (the demo's workers)
    ddp_train.py          the DDP communication hook in a plain DDP loop (--plain-ddp: without it)
    accelerate_train.py   the hook on Accelerate's prepared model
    lightning_train.py    the hook under PyTorch Lightning (a callback)
    hf_trainer_train.py   the hook under Hugging Face Trainer (a callback), a BERT built from a config

The last three import their framework, which cgx-ps does not depend on.
"""

from __future__ import annotations

import sys
from typing import Callable

from cgx_ps.worker import CgxPsError

__all__ = ["run"]


def run(main: Callable[[], None]) -> None:
    """An example's entry point: a cgx-ps error ends it with its one-line message (the message names
    the cause and what to check; the traceback adds nothing for a user), Ctrl-C with exit status
    130 (128 + SIGINT, as a shell reports it), quietly."""
    try:
        main()
    except CgxPsError as exc:
        sys.exit(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        sys.exit(130)
