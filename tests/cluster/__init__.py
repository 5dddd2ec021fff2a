"""Tests of s2t2_dist/cluster/: the launch layout and the SLURM launch layer (one module starts a real cluster)."""
