"""The arrays of ended launches, kept for the next ones (``POOL``)."""

import sys
import threading
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from mpmd import _jax


class PoolInfo(NamedTuple):
  """``Pool.cache_info()``, as ``functools.lru_cache`` words it (sizes in
  bytes)."""

  hits: int
  misses: int
  maxsize: int
  currsize: int


class Pool:
  """Arrays of buffers whose launch has ended, kept for the next launches'
  buffers of the same shape and dtype (``take``). A launch of a large
  kernel makes hundreds of MB of buffers; fresh ones cost a page fault per
  4 KB as they are first written (filled with garbage, copied from an
  input), which took a third of a fused MoE launch; kept ones are written
  in place. Holds at most ``max_bytes`` (shared by all kernels and
  threads; what does not fit is freed). A cache of JAX's cache management:
  ``jax.clear_caches()`` empties it.

  A launch's outputs leave it: its host callback returns them and XLA
  copies them into its own buffers. They are *lent* (``lend``): kept here
  but not taken until nothing else refers to them any more (XLA has
  copied them and dropped them), which the reference count says."""

  def __init__(self, max_bytes: int):
    self.max_bytes = max_bytes
    self.held = 0
    self.free: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}
    self.lent: list[np.ndarray] = []
    self.lock = threading.Lock()
    self.hits = self.misses = 0
    _jax.util.register_cache(self, "mpmd: the checking executor's arrays")

  def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` with any contents."""
    dtype = np.dtype(dtype)
    with self.lock:
      kept = self.free.get((shape, dtype))
      if not kept and self.lent:
        self._returned()
        kept = self.free.get((shape, dtype))
      if kept:
        array = kept.pop()
        self.held -= array.nbytes
        self.hits += 1
        return array
      self.misses += 1
    return np.empty(shape, dtype)

  # -- JAX's cache management ------------------------------------------------

  def cache_clear(self) -> None:
    with self.lock:
      self.free.clear()
      self.lent.clear()
      self.held = 0

  def cache_info(self) -> PoolInfo:
    with self.lock:
      return PoolInfo(self.hits, self.misses, self.max_bytes, self.held)

  def cache_keys(self) -> list[tuple[tuple[int, ...], np.dtype]]:
    with self.lock:
      return [key for key, kept in self.free.items() if kept]

  def give(self, arrays: Iterable[np.ndarray]) -> None:
    """Keeps ``arrays`` (nothing else may use them any more) while they
    fit."""
    with self.lock:
      for array in arrays:
        if self._fits(array):
          self.free.setdefault((array.shape, array.dtype), []).append(array)

  def lend(self, arrays: Iterable[np.ndarray]) -> None:
    """Keeps ``arrays``, which others may still use, while they fit;
    ``take`` hands one out only once it is nobody else's."""
    with self.lock:
      for array in arrays:
        if array.base is None and self._fits(array):
          self.lent.append(array)

  def _fits(self, array: np.ndarray) -> bool:
    if self.held + array.nbytes > self.max_bytes:
      return False
    self.held += array.nbytes
    return True

  def _returned(self) -> None:
    """Moves the lent arrays that nothing else refers to any more to the
    free ones (under ``lock``)."""
    lent, self.lent = self.lent, []
    for array in lent:
      if sys.getrefcount(array) <= _UNREFERENCED:
        self.free.setdefault((array.shape, array.dtype), []).append(array)
      else:
        self.lent.append(array)


def _unreferenced() -> int:
  """``sys.getrefcount`` of an array that only a list refers to, read as
  ``Pool._returned`` reads it (the list, the loop's name, the call's
  argument)."""
  for array in [np.empty(0)]:
    return sys.getrefcount(array)
  raise AssertionError


_UNREFERENCED = _unreferenced()

# The arrays one launch of a fused MoE layer at the bench's small shape
# makes (inputs' copies, VMEM scratch, outputs, their written flags: 280
# MB) fit.
POOL = Pool(max_bytes=512 << 20)
