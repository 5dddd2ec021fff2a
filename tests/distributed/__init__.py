"""Tests of s2t2_dist/distributed/: collectives, process exit, the sharded Sinkhorn, the batched statistics."""
