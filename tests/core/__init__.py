"""Tests of the package's top-level modules: config loading and its docs, the CLI's help texts, S2T2_* variables,
the registry."""
