"""Expert-parallel mixture-of-experts on ``mpmd_map``.

* :func:`ragged_all_to_all`: ``jax.lax.ragged_all_to_all`` by remote DMAs,
  which runs on the CPU fallback (XLA:CPU has no such op) and lowers for TPU.
"""

from mpmd.kernels.moe.ragged import ragged_all_to_all as ragged_all_to_all

__all__ = ["ragged_all_to_all"]
