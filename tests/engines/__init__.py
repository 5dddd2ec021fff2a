"""Tests of s2t2_dist/engines/: engine selection and config, DeepSpeed and FSDP2 under the real launchers."""
