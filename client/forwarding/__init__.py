"""Forwarding a request: the failover loop, one attempt on one backend, stream relaying."""
