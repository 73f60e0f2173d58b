"""Example training scripts, shipped in the package so ``cgx-ps demo`` and
``torchrun -m cgx_ps.examples.train`` work from an installed wheel; copy one to start your own."""
