"""After the forward, in plain Python (no torch): stop rules, forks, beams, text deltas."""
