"""Example training scripts, shipped in the package so ``cgx-ps demo`` and
``torchrun -m cgx_ps.examples.train`` work from an installed wheel; copy one to start your own.

    train.py              DistributedOptimizer in a plain loop (the demo's workers)
    ddp_train.py          the DDP communication hook in a plain DDP loop (--plain-ddp: without it)
    accelerate_train.py   the hook on Accelerate's prepared model
    lightning_train.py    the hook under PyTorch Lightning (a callback)
    hf_trainer_train.py   the hook under Hugging Face Trainer (a callback), a BERT built from a config

The last three import their framework, which cgx-ps does not depend on.
"""
