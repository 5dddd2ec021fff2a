"""The test suite: one folder per part of the package (s2t2_dist/<part>/ -> tests/<part>/), plus tests/bench/ (the
benchmark scripts of bench/), tests/core/ (the package's top-level modules: config, CLI, environment, registry),
tests/project/ (repository-wide rules), tests/faults/ (the reliability suite) and tests/helpers/ (shared helpers,
no tests)."""
