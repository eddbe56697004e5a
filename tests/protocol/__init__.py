"""The wire contract's validation rules."""
