"""Tests of s2t2_dist/models/: Hugging Face models of any architecture, load checks, the translated LM, the chunked
loss."""
