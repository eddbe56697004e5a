"""Choosing a backend: the registry with its heartbeats, the balancing policies, the router."""
