"""The continuous-batching server: its async front and its HTTP API."""
