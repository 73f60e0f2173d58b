"""What shards and workers share to reach each other: addresses, channel options, the job token and TLS
material, and the hand-written framings of the Exchange stream (gRPC chunks, the raw data plane)."""
