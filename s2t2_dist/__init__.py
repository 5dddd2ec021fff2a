"""s2t2-dist: distributed Sparse Sinkhorn Token Translation."""

__version__ = "0.1.0"
