"""Benchmark and demo harness (kvstream bench, kvstream demo)."""
