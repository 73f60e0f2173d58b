"""The shard process's resources: the C allocator's thresholds, the open-file limit, memory sizing."""
