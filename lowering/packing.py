"""Values of every device in one collective: an ``all_gather`` of their
leaves packed as unsigned words (bit-exact, whatever their dtypes).

Each collective is a rendezvous of every device, so the lockstep path
(``mpmd._lowering.exchange``) sends all that one exchange carries in one.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import dtypes, lax
from jax.typing import DTypeLike


def traced(x: Any) -> bool:
  """Whether a leaf travels: Python ints (static indices) are the same on
  every device."""
  return not isinstance(x, int)


class Gathered:
  """Every device's ``leaves``, gathered in one collective: each collective
  is a rendezvous of every device. Static leaves (Python ints, the same on
  every device) stay behind."""

  def __init__(self, axes: Any, leaves: list[Any]):
    self._leaves = leaves
    self._where: dict[int, int] = {}  # leaf -> offset in the words
    self.words: jax.Array | None = None  # every device's, once gathered
    moving = [i for i, x in enumerate(leaves) if traced(x)]
    if not moving:
      return
    given = {i: jnp.asarray(leaves[i]) for i in moving}
    self._dtypes = {i: x.dtype for i, x in given.items()}
    arrays = {i: wire(x) for i, x in given.items()}
    # Packed in words of the widest payload's width: a bitcast between
    # types of one width is free, between widths it is not (XLA shifts and
    # adds every byte), so only the small leaves change width.
    widest = max(arrays.values(), key=lambda x: x.size * byte_width(x.dtype))
    self._word = WORDS[byte_width(widest.dtype)]
    offset = 0
    for i, x in arrays.items():
      self._where[i] = offset
      offset += _num_words(x, self._word)
    self._arrays = arrays
    self.words = lax.all_gather(
      jnp.concatenate([_to_words(x, self._word) for x in arrays.values()]),
      axes,
    )

  def _slice(self, i: int) -> jax.Array:
    """Every device's words of leaf ``i`` (a traced one: gathered)."""
    assert self.words is not None
    start = self._where[i]
    end = start + _num_words(self._arrays[i], self._word)
    return self.words[:, start:end]

  def stacked(self, i: int) -> jax.Array | None:
    """Leaf ``i`` of every device, stacked (None if static)."""
    if i not in self._where:
      return None
    return _unwire(
      _from_words(self._slice(i), self._arrays[i]), self._dtypes[i]
    )

  def row(self, i: int, j: jax.Array) -> Any:
    """Leaf ``i`` of device ``j`` (traced): picked while still in words,
    so that XLA copies one row only (a pick after the bitcast to bf16 it
    upcasts whole, and splits across threads)."""
    if i not in self._where:
      return self._leaves[i]
    rows = lax.dynamic_slice_in_dim(self._slice(i), j, 1)
    return _unwire(_from_words(rows, self._arrays[i])[0], self._dtypes[i])


# Unsigned words of each width: collectives move them bit-exactly.
WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def wire(x: jax.Array) -> jax.Array:
  """``x`` in a dtype that bitcasts to unsigned words: complex numbers as
  (real, imaginary) pairs along a new last axis, types narrower than a
  byte (int4, float4) widened to one that holds their values exactly."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if dtypes.itemsize_bits(x.dtype) < 8:
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
      return x.astype(jnp.int8)
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
      return x.astype(jnp.uint8)
    return x.astype(jnp.float32)
  return x


def _unwire(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """The inverse of :func:`wire`, back to ``dtype``."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return lax.complex(x[..., 0], x[..., 1])
  return x if x.dtype == dtype else x.astype(dtype)


def byte_width(dtype: DTypeLike) -> int:
  return 1 if dtype == jnp.bool_ else np.dtype(dtype).itemsize


def _num_words(x: jax.Array, word: DTypeLike) -> int:
  width = np.dtype(word).itemsize
  return -(-x.size * byte_width(x.dtype) // width)


def _to_words(x: jax.Array, word: DTypeLike) -> jax.Array:
  """``x`` as a flat vector of ``word`` (zero-padded)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  width = np.dtype(word).itemsize
  if x.dtype.itemsize == width:
    return lax.bitcast_convert_type(x, word).reshape(-1)
  flat = lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)
  flat = jnp.pad(flat, (0, _num_words(x, word) * width - flat.size))
  if width == 1:
    return flat
  return lax.bitcast_convert_type(flat.reshape(-1, width), word)


def _from_words(rows: jax.Array, like: jax.Array) -> jax.Array:
  """Rows of ``_to_words`` of arrays like ``like``, stacked, as they were."""
  count, width = rows.shape[0], rows.dtype.itemsize
  like_width = byte_width(like.dtype)
  if like_width != width:
    rows = lax.bitcast_convert_type(rows, jnp.uint8).reshape(count, -1)
    rows = rows[:, : like.size * like_width]
    if like_width > 1:
      rows = rows.reshape(count, -1, like_width)
  rows = rows.reshape(count, *like.shape, *rows.shape[2:])
  if like.dtype == jnp.bool_:
    return rows != 0
  return lax.bitcast_convert_type(rows, like.dtype)
