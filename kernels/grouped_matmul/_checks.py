"""Input checks of ``gmm`` and ``tgmm``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpmd.kernels import _common

SUPPORTED_DTYPES = (
  jnp.dtype(jnp.float32),
  jnp.dtype(jnp.bfloat16),
  jnp.dtype(jnp.float16),
)


def check_float_operand(name: str, arg: str, x: Any, rank: int, shape_doc: str):
  """A non-empty float32/bfloat16/float16 array of ``rank``."""
  _common.check_array(
    name, arg, x, rank=rank, shape_doc=shape_doc, nonempty=True
  )
  _common.check_dtype(name, arg, x, SUPPORTED_DTYPES)


def check_group_sizes(name: str, group_sizes: Any):
  """Checks the type; a concrete array's sizes must be non-negative (traced
  ones cannot be checked: ``group_rows`` says what they mean)."""
  _common.check_array(
    name,
    "group_sizes",
    group_sizes,
    rank=1,
    shape_doc="(num_groups,)",
    nonempty=True,
  )
  _common.check_dtype(name, "group_sizes", group_sizes, (jnp.int32,))
  if not isinstance(group_sizes, jax.Array | np.ndarray):
    return
  try:
    sizes = np.asarray(group_sizes)
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
  ):
    return  # traced
  negative = np.flatnonzero(sizes < 0)
  if negative.size:
    i = int(negative[0])
    raise ValueError(
      f"{name}: expected non-negative 'group_sizes', got "
      f"group_sizes[{i}] = {int(sizes[i])}"
    )


def check_gmm_operands(
  name: str, lhs: Any, rhs: Any, group_sizes: Any, transpose_rhs: bool
) -> tuple[int, int, int]:
  """Checks ``gmm``'s arrays against each other; returns ``(m, k, n)``."""
  rhs_doc = "(num_groups, n, k)" if transpose_rhs else "(num_groups, k, n)"
  check_float_operand(name, "lhs", lhs, 2, "(m, k)")
  check_float_operand(name, "rhs", rhs, 3, rhs_doc)
  check_group_sizes(name, group_sizes)
  m, k = lhs.shape
  rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if rhs_k != k:
    raise ValueError(
      f"{name}: expected 'rhs' {rhs_doc} with k={k} (lhs is {(m, k)}), "
      f"got shape {tuple(rhs.shape)}"
      + (
        ""
        if transpose_rhs
        else "; for (num_groups, n, k) weights pass transpose_rhs=True"
      )
    )
  num_groups = group_sizes.shape[0]
  if rhs.shape[0] > num_groups:
    raise ValueError(
      f"{name}: expected 'rhs' to hold at most num_groups={num_groups} "
      f"groups (the length of 'group_sizes'), got {rhs.shape[0]}"
    )
  return m, k, n


def check_tgmm_operands(
  name: str, lhs: Any, rhs: Any, group_sizes: Any
) -> tuple[int, int, int]:
  """Checks ``tgmm``'s arrays against each other; returns ``(k, m, n)``."""
  check_float_operand(name, "lhs", lhs, 2, "(k, m)")
  check_float_operand(name, "rhs", rhs, 2, "(m, n)")
  check_group_sizes(name, group_sizes)
  k, m = lhs.shape
  n = rhs.shape[1]
  if rhs.shape[0] != m:
    raise ValueError(
      f"{name}: expected 'rhs' (m, n) with m={m} rows (lhs is {(k, m)}), "
      f"got shape {tuple(rhs.shape)}"
    )
  return k, m, n


def check_num_actual_groups(
  name: str, num_actual_groups: Any, num_groups: int
) -> int:
  """``tgmm``'s ``num_actual_groups`` checked (None: all groups)."""
  if num_actual_groups is None:
    num_actual_groups = num_groups
  num_actual_groups = _common.check_int(
    name, "num_actual_groups", num_actual_groups
  )
  if num_actual_groups > num_groups:
    raise ValueError(
      f"{name}: expected 'num_actual_groups' in [1, {num_groups}] "
      f"(num_groups), got {num_actual_groups}"
    )
  return num_actual_groups


def check_group_offset(
  name: str, group_offset: Any, num_groups: int, num_local: int
) -> jax.Array:
  """The offset as an int32 scalar; a concrete one must keep the local
  groups ``[offset, offset + num_local)`` inside ``[0, num_groups)`` (a
  traced one cannot be checked: out of range, it is clamped)."""
  if group_offset is None:
    return jnp.zeros((), jnp.int32)
  if isinstance(group_offset, bool) or not (
    isinstance(group_offset, int | np.integer) or hasattr(group_offset, "dtype")
  ):
    raise TypeError(
      f"{name}: expected 'group_offset' to be an int32 scalar, got "
      f"{type(group_offset).__name__}"
    )
  if not isinstance(group_offset, int | np.integer):
    if jnp.dtype(group_offset.dtype) != jnp.int32:
      raise TypeError(
        f"{name}: expected 'group_offset' of dtype int32, got "
        f"{jnp.dtype(group_offset.dtype).name}"
      )
    if group_offset.shape not in ((), (1,)):
      raise ValueError(
        f"{name}: expected 'group_offset' of shape () (one int32), got "
        f"shape {tuple(group_offset.shape)}"
      )
  try:
    value = int(np.asarray(group_offset).reshape(()))
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
  ):
    value = None  # traced: cannot be checked here
  if value is not None and not 0 <= value <= num_groups - num_local:
    raise ValueError(
      f"{name}: expected 'group_offset' in [0, {num_groups - num_local}] "
      f"(num_groups={num_groups} minus the {num_local} local groups), "
      f"got {value}"
    )
  return jnp.reshape(jnp.asarray(group_offset, jnp.int32), ())


def check_existing_out(
  name: str, existing_out: Any, shape: tuple[int, ...], dtype: jnp.dtype
):
  if existing_out is None:
    return
  _common.check_array(name, "existing_out", existing_out)
  if tuple(existing_out.shape) != shape:
    raise ValueError(
      f"{name}: expected 'existing_out' of shape {shape}, got "
      f"{tuple(existing_out.shape)}"
    )
  if jnp.dtype(existing_out.dtype) != dtype:
    raise TypeError(
      f"{name}: expected 'existing_out' of dtype {dtype.name} (the "
      f"preferred_element_type), got {jnp.dtype(existing_out.dtype).name}"
    )


def input_dtype(lhs: jax.Array, rhs: jax.Array) -> jnp.dtype:
  # Mixed operands are multiplied in f32, as megablox does.
  if lhs.dtype == rhs.dtype:
    return jnp.dtype(lhs.dtype)
  return jnp.dtype(jnp.float32)
