"""The gateway: routing, balancing, failover, jumpers, streams, the openai SDK."""
