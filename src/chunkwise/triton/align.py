"""Moved to chunkwise.triton.common (kept only until every importer has switched)."""
from .common import aligned_dim, cdiv, cut_state, next_pow2, pad_last, pad_state, padded_dims  # noqa: F401
