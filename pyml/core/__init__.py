"""Stateless array math, the runtime configuration and perf logging. No I/O, no model knowledge."""
