"""Held-out evaluation: perplexity per target token and bits-per-byte (BpB)."""
