"""The worker's connections to the shards: the communication thread (engine), one client per shard
(a facade over its control connection, its exchange stream and their supervisor), the recovery
decisions, the Exchange call on either data plane (gRPC, raw) and the TLS probe."""
