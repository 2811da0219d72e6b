"""The OpenAI-compatible gateway in front of the cluster: `create_app(backend, settings)`."""
