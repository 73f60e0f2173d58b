"""Intra-node reduction: a node's local ranks sum their gradients through shared memory (CPU) or CUDA
IPC (GPU) first, so each node pushes one compressed copy."""
