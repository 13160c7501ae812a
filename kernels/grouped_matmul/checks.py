"""Input checks of ``gmm`` and ``tgmm``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_SUPPORTED_DTYPES = (
  jnp.dtype(jnp.float32),
  jnp.dtype(jnp.bfloat16),
  jnp.dtype(jnp.float16),
)


def check_array(name: str, arg: str, x: Any, rank: int, shape_doc: str):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
      f"{name}: expected '{arg}' to be an array {shape_doc}, got "
      f"{type(x).__name__}"
    )
  if x.ndim != rank:
    raise ValueError(
      f"{name}: expected '{arg}' of rank {rank} {shape_doc}, got rank "
      f"{x.ndim} with shape {tuple(x.shape)}"
    )
  if any(d == 0 for d in x.shape):
    raise ValueError(
      f"{name}: expected '{arg}' {shape_doc} with no zero-sized "
      f"dimension, got shape {tuple(x.shape)}"
    )


def check_float(name: str, arg: str, x: Any):
  if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
    raise TypeError(
      f"{name}: expected '{arg}' of dtype float32, bfloat16 or float16, "
      f"got {jnp.dtype(x.dtype).name}"
    )


def check_group_sizes(name: str, group_sizes: Any):
  """Checks the type; a concrete array's sizes must be non-negative (traced
  ones cannot be checked: ``group_rows`` says what they mean)."""
  check_array(name, "group_sizes", group_sizes, 1, "(num_groups,)")
  if jnp.dtype(group_sizes.dtype) != jnp.int32:
    raise TypeError(
      f"{name}: expected 'group_sizes' of dtype int32, got "
      f"{jnp.dtype(group_sizes.dtype).name}"
    )
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


def check_out_dtype(name: str, preferred_element_type: Any) -> jnp.dtype:
  try:
    dtype = jnp.dtype(preferred_element_type)
  except TypeError:
    raise TypeError(
      f"{name}: expected 'preferred_element_type' to be a dtype, got "
      f"{preferred_element_type!r}"
    ) from None
  if dtype not in _SUPPORTED_DTYPES:
    raise TypeError(
      f"{name}: expected 'preferred_element_type' float32, bfloat16 or "
      f"float16, got {dtype.name}"
    )
  return dtype


def check_existing_out(
  name: str, existing_out: Any, shape: tuple[int, ...], dtype: jnp.dtype
):
  if existing_out is None:
    return
  if not hasattr(existing_out, "shape") or not hasattr(existing_out, "dtype"):
    raise TypeError(
      f"{name}: expected 'existing_out' to be an array, got "
      f"{type(existing_out).__name__}"
    )
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
