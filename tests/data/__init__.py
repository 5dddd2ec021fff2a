"""Tests of s2t2_dist/data/: records, split, BPE, shards, loaders and the prepare pipeline."""
