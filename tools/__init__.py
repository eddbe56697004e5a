"""Commands around the suite: building the default model folder, the demo question."""
