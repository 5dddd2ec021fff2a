"""Small collective helpers shared by the engines (they live in s2t2_dist.dist.collectives)."""

from __future__ import annotations

from s2t2_dist.dist.collectives import raise_if_any_failed

__all__ = ["raise_if_any_failed"]
