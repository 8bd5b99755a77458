"""Tooling around the core packages: benchmarks, load tests, demos, calibration."""
