"""Kernels built on ``mpmd_map``, each checked against plain JAX.

* ``all_gather_matmul`` / ``matmul_reduce_scatter``: ring collective matmul
  (TPU), used inside ``jax.shard_map``.
* ``gmm`` / ``tgmm``: grouped matmul for mixture-of-experts (TPU).
* ``ragged_all_to_all``: ``jax.lax.ragged_all_to_all`` by remote DMAs, for
  expert-parallel mixture-of-experts (runs on CPU, lowers for TPU).
* ``moe``: an expert-parallel mixture-of-experts layer built on it and
  ``gmm``.
* ``mpmd.kernels.gpu``: software-pipelined and warp-specialized Mosaic GPU
  pipelines and matmuls (CUDA).

Each TPU kernel has two named implementations, picked by its
``implementation=`` argument: the one a TPU runs and the CPU fallback's
default. Both lower for TPU and run on the CPU fallback; ``None`` (the
default) picks the TPU's when building for TPU (on a TPU, inside
``mpmd.tpu_target``) or simulating one (``pltpu.InterpretParams``), else
the CPU's. Name the TPU's to test on CPU what a TPU runs:

* ``all_gather_matmul`` / ``matmul_reduce_scatter``: ``"ring"`` (TPU),
  ``"direct"`` (CPU);
* ``gmm`` / ``tgmm``: ``"tiled"`` (TPU; also whenever a ``tiling`` is
  given), ``"windows"`` (CPU);
* ``ragged_all_to_all``: ``"conditional"`` (TPU), ``"window"`` (CPU).
"""

from mpmd.kernels import gpu as gpu
from mpmd.kernels.collective_matmul import (
  all_gather_matmul as all_gather_matmul,
)
from mpmd.kernels.collective_matmul import (
  matmul_reduce_scatter as matmul_reduce_scatter,
)
from mpmd.kernels.grouped_matmul import gmm as gmm
from mpmd.kernels.grouped_matmul import tgmm as tgmm
from mpmd.kernels.moe import moe as moe
from mpmd.kernels.moe import ragged_all_to_all as ragged_all_to_all

__all__ = [
  "all_gather_matmul",
  "gmm",
  "gpu",
  "matmul_reduce_scatter",
  "moe",
  "ragged_all_to_all",
  "tgmm",
]
