"""Tests of s2t2_dist/translator/: the token translator, its kinds, floor, start, product, P files and recipe."""
