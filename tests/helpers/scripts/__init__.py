"""Programs of the test suite (no tests collected from here): scripts the tests start as processes (engines_script.py
under the real launchers, the Triton-interpreted suites run by tests/ot/test_gpu_kernels.py) and tools run by hand
(misuse_table.py, ledger_table.py, timeline.py)."""
