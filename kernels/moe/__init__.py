"""Expert-parallel mixture-of-experts on ``mpmd_map``.

* :func:`ragged_all_to_all`: ``jax.lax.ragged_all_to_all`` by remote DMAs,
  which runs on the CPU fallback (XLA:CPU has no such op) and lowers for TPU.
* :func:`moe`: a dropless expert-parallel MoE layer: top-k routing, dispatch
  by ``ragged_all_to_all``, ``gmm`` over the local experts, combine by the
  reverse exchange; with ``fused=True`` all three in one two-mesh launch
  (a dispatch program next to a compute program, ``_fused.py``).
"""

from mpmd.kernels.moe.layer import moe as moe
from mpmd.kernels.moe.ragged import ragged_all_to_all as ragged_all_to_all

__all__ = ["moe", "ragged_all_to_all"]
