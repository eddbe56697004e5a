"""Helpers every area uses: servers in threads, the default model's settings, waiting."""
