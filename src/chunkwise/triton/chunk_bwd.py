"""Transitional: chunk_bwd moved to chunk.py; this name stays until chunkwise._custom_ops imports it from there."""
from .chunk import chunk_bwd  # noqa: F401
from .configs import gate_scaled_in, saved_t_dtype  # noqa: F401
