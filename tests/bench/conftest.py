"""Smoke tests of the benchmarks and the demo in bench/: each runs small and checks the figures it
reports. Shared fixtures are in tests/conftest.py."""
