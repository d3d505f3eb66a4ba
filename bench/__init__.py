"""Benchmarks, run from the repository root as modules (`python -m bench.rollout`); each writes
JSON to bench/results/ with the machine's load recorded beside the numbers."""
