"""Clients of the runtime: planner, simulator, tuner, benchmarks, config migration, generation."""
