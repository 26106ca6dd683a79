"""Operator tools: benchmark, profiler, health checker, defrag, prune."""
