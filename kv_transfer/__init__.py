"""Moving KV blocks from a prefill engine to a decode engine: gRPC control, pluggable payload path."""
