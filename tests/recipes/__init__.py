"""Tests of s2t2_dist/recipes/: source-LM recipes, the demo, `s2t2 reproduce`."""
