"""Tests of s2t2_dist/train/: the loop, its callbacks, the optimiser."""
