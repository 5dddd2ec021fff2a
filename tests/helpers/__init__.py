"""Shared helpers of the test suite (no tests here): fixtures and tools imported as `tests.helpers.<module>`."""
