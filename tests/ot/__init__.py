"""Tests of s2t2_dist/ot/: the sparse Sinkhorn, sparsemax, the surface-string prior, and the GPU kernels under
Triton's interpreter."""
