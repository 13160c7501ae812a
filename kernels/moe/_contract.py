"""The ragged exchange's contract, checked on the CPU fallback before any
row moves.

JAX leaves a ragged all-to-all undefined where a slice leaves ``operand``
or its receiver's ``output``, or where a receiver's ``recv_sizes`` disagree
with what its senders send; a TPU faults, or waits forever. On CPU each is
a typed error naming the device, the slice and the arguments.

Every device of the exchange checks everyone's metadata (an all-gather of a
few integers), so that all raise together: a device that raised alone
would leave its peers waiting in the next collective, which XLA:CPU ends by
aborting the process. Python runs only to raise.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from mpmd import errors, targets
from mpmd._lowering import errors as launch_errors
from mpmd.kernels.moe._peers import Groups

# The exchange's metadata: one row per argument, each of length k * D.
FIELDS = range(4)
_IN_OFF, _SEND, _OUT_OFF, _RECV = FIELDS


def valid(in_off, size, out_off, n: int, m: int):
  """Whether a slice lies inside ``operand`` (``n`` rows) and ``output``
  (``m`` rows), numpy or traced."""
  return (
    (size >= 0)
    & (in_off >= 0)
    & (in_off <= n - size)
    & (out_off >= 0)
    & (out_off <= m - size)
  )


def check(fn: str, groups: Groups, meta: jax.Array, n: int, m: int):
  """An int32 zero, once every device's slices lie inside ``operand`` (``n``
  rows) and their receivers' ``output`` (``m`` rows) and every
  ``recv_sizes`` entry is what its sender sends; else, on the CPU
  fallback, an ``mpmd.OutOfBoundsError`` (a slice out of range), or an
  ``mpmd.DeadlockError`` (more rows announced than sent: a TPU would wait
  forever) or ``mpmd.LeftoverError`` (fewer: rows nobody waits for).
  ``meta``: (4, k * D) int32. Add the zero to what the exchange reads, so
  that the check comes first. Nothing when building for TPU."""
  if targets.platform() != "cpu":  # (no callback where none can run)
    return jnp.int32(0)
  contract = _Contract(groups, n, m, meta.shape[-1])
  fail = functools.partial(_fail, fn, contract)

  def check_all(meta):
    gathered = lax.all_gather(meta, groups.axes)  # (devices, ..., 4, k * D)
    invalid, disagree, _ = contract.violations(gathered)
    return lax.cond(
      jnp.any(invalid) | jnp.any(disagree),
      lambda: io_callback(fail, jax.ShapeDtypeStruct((), jnp.int32), gathered),
      lambda: jnp.int32(0),
    )

  # Under vmap, one check of the whole batch (JAX cannot batch a cond with
  # a callback inside).
  checked = jax.custom_batching.custom_vmap(check_all)
  checked.def_vmap(lambda _, __, meta: (check_all(meta), False))
  return checked(meta)


class _Contract:
  """The contract over every device's metadata, numpy or traced."""

  def __init__(self, groups: Groups, n: int, m: int, width: int):
    self.groups, self.n, self.m, self.k = groups, n, m, width // groups.size
    # Element e = j * k + s of receiver p's recv_sizes counts what device
    # source[p, e] (position j of p's group) sends in element
    # element[p, e] of its send_sizes (p's position * k + s).
    devices = sum(len(g) for g in groups.members)
    self.source = np.zeros((devices, width), np.int32)
    self.element = np.zeros((devices, width), np.int32)
    for group in groups.members:
      for r, p in enumerate(group):
        for e in range(width):
          j, s = divmod(e, self.k)
          self.source[p, e], self.element[p, e] = group[j], r * self.k + s

  def violations(self, meta: Any) -> tuple[Any, Any, Any]:
    """For ``meta`` (devices, ..., 4, k * D): per slice, whether it leaves
    its buffers; per received slice, whether ``recv_sizes`` disagrees with
    the size sent (a valid slice's); and those sizes sent (devices,
    batch, k * D)."""
    meta = meta.reshape(meta.shape[0], -1, *meta.shape[-2:])
    in_off, size, out_off = (meta[:, :, f] for f in (_IN_OFF, _SEND, _OUT_OFF))
    invalid = ~valid(in_off, size, out_off, self.n, self.m)
    batch = np.arange(meta.shape[1])[None, :, None]
    source, element = self.source[:, None, :], self.element[:, None, :]
    sent = size[source, batch, element]
    disagree = ~invalid[source, batch, element] & (sent != meta[:, :, _RECV])
    return invalid, disagree, sent


def _coords(groups: Groups, index: int) -> dict[str, int]:
  """Mesh coordinates of the device of flattened index ``index``."""
  out = {}
  for axis, size in zip(groups.axes[::-1], groups.sizes[::-1], strict=True):
    index, out[axis] = divmod(index, size)
  return dict(reversed(out.items()))


def _fail(fn: str, c: _Contract, meta) -> np.int32:
  meta = np.asarray(meta)
  invalid, disagree, sent = c.violations(meta)
  meta = meta.reshape(meta.shape[0], -1, *meta.shape[-2:])
  if invalid.any():
    p, b, i = map(int, np.argwhere(invalid)[0])
    error = errors.OutOfBoundsError(
      _out_of_range(fn, c, p, i, meta[p, b, :, i]) + f"; {invalid.sum()} "
      "slices leave their buffers"
    )
  elif disagree.any():
    p, b, i = map(int, np.argwhere(disagree)[0])
    got, want = int(meta[p, b, _RECV, i]), int(sent[p, b, i])
    why, kind = (
      ("it would wait forever for rows never sent", errors.DeadlockError)
      if got > want
      else ("rows would arrive that it never waits for", errors.LeftoverError)
    )
    error = kind(
      f"{fn}: device {_coords(c.groups, p)} announces recv_sizes[{i}] = "
      f"{got} rows of slice {i % c.k} from device "
      f"{_coords(c.groups, int(c.source[p, i]))}, which sends {want} (its "
      f"send_sizes[{c.element[p, i]}]): on a TPU {why} (JAX leaves the "
      f"result undefined); {disagree.sum()} of the announced sizes disagree"
    )
  else:
    return np.int32(0)
  raise launch_errors.remember(error)


def _out_of_range(fn: str, c: _Contract, p, i, fields) -> str:
  in_off, size, out_off = (int(fields[f]) for f in (_IN_OFF, _SEND, _OUT_OFF))
  if size < 0:
    what = f"send_sizes[{i}] = {size} is negative"
  elif in_off < 0 or in_off > c.n - size:
    what = (
      f"input_offsets[{i}] = {in_off} and send_sizes[{i}] = {size} name "
      f"rows [{in_off}, {in_off + size}) of 'operand', which has {c.n}"
    )
  else:
    what = (
      f"output_offsets[{i}] = {out_off} and send_sizes[{i}] = {size} name "
      f"rows [{out_off}, {out_off + size}) of its receiver's 'output', "
      f"which has {c.m}"
    )
  if -1 in (in_off, size, out_off):
    what += " (an offset or size outside int32 reads as -1)"
  return (
    f"{fn}: device {_coords(c.groups, p)}'s slice {i} (to group position "
    f"{i // c.k}): {what}: out of bounds (a TPU would fault; JAX leaves "
    "the result undefined)"
  )
