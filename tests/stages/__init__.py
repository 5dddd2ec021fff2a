"""Tests of s2t2_dist/stages/: prepare, translate, finetune and evaluate as users run them, and their validation."""
