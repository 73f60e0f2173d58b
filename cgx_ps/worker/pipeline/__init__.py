"""The block pipeline: a step's per-block work (flat buffers, error feedback, encode, push, pull, decode)
and its part of a checkpoint."""
