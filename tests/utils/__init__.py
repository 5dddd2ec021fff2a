"""Tests of s2t2_dist/utils/: atomic I/O and the host-sync counter."""
