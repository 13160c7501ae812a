"""Grouped matrix multiplication (``gmm``, ``tgmm``) on ``mpmd_map``.

The mixture-of-experts workhorse: rows of ``lhs`` are sorted by expert
("group"), ``group_sizes[i]`` rows belong to expert ``i``, and each group is
multiplied by its own expert weights. Semantics and arguments follow
megablox (``jax.experimental.pallas.ops.tpu.megablox``); the reference is
``jax.lax.ragged_dot``.

How the kernel works. ``mpmd_map`` has no automatic pipelining: its refs live
in HBM (``ANY``) and the body moves tiles itself. The wrapper turns
``group_sizes`` into a *visit list* (plain JAX, before the kernel): one entry
per (row tile, group) pair that has work, plus one entry for every row tile
that no local group touches, so that every output tile is written exactly
once per column strip and nothing is left uninitialised. The list is copied
into SMEM at the start of the kernel and drives ``pltpu.emit_pipeline``,
whose BlockSpec index maps read it to pick the lhs row tile and the rhs
expert of each step. Tiles that straddle a group boundary are visited once
per group and written under a row mask; consecutive visits of a tile keep
the output block in VMEM.

Ragged edges (K or N not a multiple of the tile) are not left to the
pipeline's out-of-bounds windows, which neither the CPU fallback nor the TPU
simulator can express: the arrays are split into a main part (whole tiles)
and a remainder strip, each a static, in-bounds view with its own block
shape. In ``gmm`` the K remainder is an extra input block accumulated on the
last K step; N remainders (and, in ``tgmm``, K remainders, which are output
dimensions there) run as a second pipeline over the strip.

Two named implementations (``implementation=``), both lowering for TPU and
running on the CPU fallback: ``"tiled"``, the kernel above (what a TPU
runs), and ``"windows"`` (``_windows.py``): per group, a dot per whole chunk
of 256 of its rows, then one over a tail window (at most 15 rows more than
the rest) under a row mask. On the CPU fallback each pipeline step is a
loop iteration around a small XLA dot, and a tile straddling a group
boundary is computed once per group, so there the default
(``implementation=None``) is ``"windows"``; building for TPU (or simulating
one) it is ``"tiled"``, as it is whenever a ``tiling`` is passed. The
pipeline depth follows the target (the abstract device of
``mpmd.tpu_target`` when cross-lowering, else the default backend): two
buffers per operand on TPU, one on the CPU fallback.
"""

from mpmd.kernels.grouped_matmul.api import gmm as gmm
from mpmd.kernels.grouped_matmul.api import tgmm as tgmm
from mpmd.kernels.grouped_matmul.tiling import Tiling as Tiling
from mpmd.kernels.grouped_matmul.tiling import TilingFn as TilingFn
from mpmd.kernels.grouped_matmul.tiling import default_tiling as default_tiling

__all__ = ["Tiling", "TilingFn", "default_tiling", "gmm", "tgmm"]
