"""Benchmarks: moeshard against the loading strategies of the projects it was started from."""
