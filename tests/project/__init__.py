"""Repository-wide rules: the package layout, lint coverage, packaging, the test suite's own layout and scheduler."""
