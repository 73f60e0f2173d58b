"""A shard's wire: the gate on every call (token, parsing, status codes), the ParameterServer servicer
and the stream context both planes hand it, the Status RPC, the raw data plane (its listener, a
connection's frames, a stream's handshake and context) and server TLS."""
