"""Helpers for tests and the CPU demo only (multi-process launcher, megatron CPU compatibility)."""
