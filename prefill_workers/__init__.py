"""Prefill workers: prompt in, first token out, KV streamed to a decode worker's reservation."""
