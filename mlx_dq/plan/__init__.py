"""The plan stage: one option per tensor for a bits-per-weight target, and plan files."""
