"""Triton interop: the protocol models, a real PyTriton server, the gateway against it."""
