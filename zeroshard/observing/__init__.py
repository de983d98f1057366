"""A run's instruments (hang watchdog, ledger dumps, profiler, metrics.jsonl, loggers) for any loop."""

from zeroshard.observing.observer import Observer, observe

__all__ = ["Observer", "observe"]
