"""What runs each step and where its KV lives: the scheduler and the block manager (no torch)."""
