"""The worker's connections to the shards: the communication thread (engine), one client per shard, its
repair (supervisor, recovery decisions), the raw data plane's call and the TLS probe."""
