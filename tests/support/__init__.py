"""Test-only helpers: the default model's settings, raw HTTP, the OpenAI facade, paths.

What the benchmarks use too (servers in threads, fakes, deployments, waiting) is in
``harness/``.
"""
