"""Parallel dims applied to a plain model: tensor, pipeline and expert parallelism."""
