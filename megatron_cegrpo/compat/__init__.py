"""Compatibility layers (CPU-only execution of megatron-core)."""

from megatron_cegrpo.compat.cpu import apply_cpu_compat, is_active

__all__ = ["apply_cpu_compat", "is_active"]
