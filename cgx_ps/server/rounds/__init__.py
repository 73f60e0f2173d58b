"""Where a shard sums gradients: pushed chunks reassembled into blocks, per-block rounds summed and
re-quantized once, within a byte budget."""
