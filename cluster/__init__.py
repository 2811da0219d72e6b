"""Control plane: Redis cluster state, node inventory, Ray placement and the pool manager."""
