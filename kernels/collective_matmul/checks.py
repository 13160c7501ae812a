"""Input checks and tile sizes of the collective matmul kernels."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from mpmd import targets
from mpmd.kernels import _common

# Tile edge the local pipelines aim for. On TPU, (512, 512) tiles of bf16
# keep two double-buffered operand tiles and an f32 accumulator at about
# 3 MiB of VMEM, well inside the scoped-VMEM default of every TPU
# generation, and make each tile matmul large enough to keep the MXU busy.
# On the CPU fallback every tile is a loop iteration with its copies and
# accumulator round trip, so fewer, larger tiles win
# (benchmarks/collective_matmul.py measures it).
_DEFAULT_BLOCK = {"tpu": 512}


_DEFAULT_BLOCK_ELSEWHERE = 2048


SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


class BlockSizes(NamedTuple):
  """Tile sizes of the local matmul pipeline (``None``: pick automatically).

  Each size must divide the dimension it tiles (for the bidirectional
  all-gather that is ``n // 2``; for the reduce-scatter, the rows/columns of
  one scattered block). On TPU, pick multiples of (8, 128) for f32 and
  (16, 128) for bf16, or the whole dimension. Automatic sizes aim at 512 on
  TPU (VMEM) and at 2048 on the CPU fallback (fewer loop iterations).
  """

  block_n: int | None = None
  block_k: int | None = None
  block_m: int | None = None


def check_operands(
  fn_name: str, lhs: Any, rhs: Any, out_dtype: Any
) -> np.dtype:
  """Checks ``lhs``/``rhs`` (2-D, float32 or bfloat16, one dtype) and returns
  the output dtype ``preferred_element_type`` names."""
  for arg_name, x in (("lhs", lhs), ("rhs", rhs)):
    _common.check_array(fn_name, arg_name, x, rank=2, nonempty=True)
    _common.check_dtype(fn_name, arg_name, x, SUPPORTED_DTYPES)
  if lhs.dtype != rhs.dtype:
    raise TypeError(
      f"{fn_name}: expected 'lhs' and 'rhs' of the same dtype, got "
      f"{jnp.dtype(lhs.dtype).name} and {jnp.dtype(rhs.dtype).name}"
    )
  return _common.as_dtype(
    fn_name, "preferred_element_type", out_dtype, SUPPORTED_DTYPES
  )


def pick_block(
  fn_name: str,
  what: str,
  dim: int,
  requested: int | None,
  platform: str | None = None,
) -> int:
  """The tile edge for a dimension: requested (checked) or automatic, for
  ``platform`` (default: the one kernels are being built for)."""
  if requested is not None:
    requested = _common.check_int(fn_name, f"block_sizes.{what}", requested)
    if dim % requested:
      raise ValueError(
        f"{fn_name}: expected block_sizes.{what} to divide the dimension "
        f"it tiles ({dim}), got {requested}"
      )
    return requested
  platform = targets.platform() if platform is None else platform
  target = _DEFAULT_BLOCK.get(platform, _DEFAULT_BLOCK_ELSEWHERE)
  if dim <= target:
    return dim
  # The largest lane-aligned divisor not above the target; else no tiling.
  for block in range(target, 0, -128):
    if dim % block == 0:
      return block
  return dim


def pick_blocks(
  fn_name: str, block_sizes: BlockSizes, rows: int, k: int, cols: int
) -> tuple[int, int, int]:
  """``(block_n, block_k, block_m)`` tiling a ``(rows, k) @ (k, cols)``
  matmul: the requested sizes (checked) or automatic ones."""
  return (
    pick_block(fn_name, "block_n", rows, block_sizes.block_n),
    pick_block(fn_name, "block_k", k, block_sizes.block_k),
    pick_block(fn_name, "block_m", cols, block_sizes.block_m),
  )


def check_block_sizes(fn_name: str, block_sizes: Any) -> BlockSizes:
  if block_sizes is None:
    return BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(
      f"{fn_name}: expected 'block_sizes' to be a BlockSizes or None, got "
      f"{type(block_sizes).__name__}"
    )
  return block_sizes
