"""A shard's wire: the gate on every call (token, parsing, status codes), the ParameterServer servicer,
the Status RPC, the raw data plane's listener and server TLS."""
