"""Tests of s2t2_dist/eval/: bits per byte."""
