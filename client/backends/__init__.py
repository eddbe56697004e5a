"""Backend kinds (our model servers, Triton servers, OpenAI-compatible upstreams), their health
state, and the translations between APIs that some kinds need."""
