"""Evaluation: perplexity, KL divergence, bits-per-weight accounting, and figures."""
