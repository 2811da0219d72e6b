"""Decode workers: KV blocks in, token stream out; and the colocated worker that does both."""
