"""Tests of the benchmark and diagnostic scripts of bench/, run as typed at tiny sizes."""
