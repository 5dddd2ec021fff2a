"""The reliability suite: faults injected into real runs (docs/reliability.md)."""
