"""The gateway's config file: its schema and the watch that re-reads it."""
