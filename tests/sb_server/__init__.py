"""The static-batching server: config, packaging, end to end behind the gateway."""
