"""One job's session on a shard: who may join (admission), its members and their outbound result
streams, and the broadcast blob store."""
