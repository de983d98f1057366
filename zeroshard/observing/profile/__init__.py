"""Measurement: where memory and time go."""
