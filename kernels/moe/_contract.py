"""The ragged exchange's contract, checked at run time on the CPU fallback.

JAX leaves a ragged all-to-all undefined where a slice leaves ``operand``
or its receiver's ``output``, or where a receiver's ``recv_sizes`` disagree
with what its senders send; a TPU faults, or waits forever. On CPU each is
a typed error naming the argument, the slice and the devices.

Every device of the exchange checks everyone's metadata (an all-gather of a
few integers), so that all raise together: a device that raised alone
would leave its peers waiting in the next collective, which XLA:CPU ends by
aborting the process. Python runs only to raise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from mpmd import errors, targets
from mpmd._lowering import errors as launch_errors
from mpmd.kernels.moe._peers import Groups

_IN_OFF, _SEND, _OUT_OFF, _RECV = range(4)  # the rows of ``meta``


def check_slices(
  fn: str, groups: Groups, meta: jax.Array, n: int, m: int
) -> jax.Array:
  """An int32 zero, once every device's slices lie inside ``operand`` (``n``
  rows) and their receivers' ``output`` (``m`` rows); else, on the CPU
  fallback, an ``mpmd.OutOfBoundsError``. ``meta``: (4, k * D) int32.
  Add the zero to what the exchange reads, so that the check comes
  first."""
  fail = functools.partial(_fail_slices, fn, groups, n, m)
  return _raise_on_cpu(groups, _invalid(n, m), fail, meta)


def check_announced(
  fn: str, groups: Groups, sent: jax.Array, announced: jax.Array
) -> None:
  """On the CPU fallback, raises where a device's ``recv_sizes``
  (``announced``, (k * D,)) disagree with the sizes its senders sent
  (``sent``, (k * D,), sender-major, as they arrived; -1 for a slice
  invalid at its sender): a TPU would wait forever for rows never sent
  (``mpmd.DeadlockError``) or receive rows nobody waits for
  (``mpmd.LeftoverError``)."""
  fail = functools.partial(_fail_announced, fn, groups)
  both = jnp.stack([sent, announced])
  _raise_on_cpu(groups, _disagree, fail, both)


def _invalid(n: int, m: int) -> Callable[[Any], Any]:
  def invalid(meta: Any) -> Any:  # (..., 4, k * D) -> per slice: leaves?
    in_off, size, out_off = (
      meta[..., f, :] for f in (_IN_OFF, _SEND, _OUT_OFF)
    )
    return (
      (size < 0)
      | (in_off < 0)
      | (in_off > n - size)
      | (out_off < 0)
      | (out_off > m - size)
    )

  return invalid


def _disagree(both: Any) -> Any:  # (..., 2, k * D): sent, announced
  sent, announced = both[..., 0, :], both[..., 1, :]
  return (sent >= 0) & (sent != announced)


def _raise_on_cpu(groups: Groups, bad, fail, x: jax.Array) -> jax.Array:
  """0 (int32); on the CPU fallback, ``fail(gathered)`` (numpy; it raises)
  first where ``bad`` holds anywhere in ``x`` gathered from every device
  of the exchange's axes (each of the same value: all raise). One check
  per batch under vmap. Nothing when building for TPU."""

  if targets.platform() != "cpu":  # (no callback where none can run)
    return jnp.int32(0)

  def check(x):
    gathered = lax.all_gather(x, groups.axes)
    result = jax.ShapeDtypeStruct((), jnp.int32)
    return lax.cond(
      jnp.any(bad(gathered)),
      lambda: io_callback(fail, result, gathered),
      lambda: jnp.int32(0),
    )

  # (JAX cannot batch a cond with a callback inside.)
  checked = jax.custom_batching.custom_vmap(check)
  checked.def_vmap(lambda _, __, x: (check(x), False))
  return checked(x)


def _first(bad: np.ndarray, x: np.ndarray) -> tuple[int, int, np.ndarray]:
  """Where ``bad`` (devices, ..., k * D) first holds: the device, the
  element, and the fields of ``x`` (devices, ..., fields, k * D) there
  (under vmap, the first batch element that has one)."""
  d, b, i = np.argwhere(bad.reshape(bad.shape[0], -1, bad.shape[-1]))[0]
  fields = x.reshape(x.shape[0], -1, *x.shape[-2:])[d, b, :, i]
  return int(d), int(i), fields


def _coords(groups: Groups, index: int) -> dict[str, int]:
  """Mesh coordinates of the device of flattened index ``index``."""
  out = {}
  for axis, size in zip(groups.axes[::-1], groups.sizes[::-1], strict=True):
    index, out[axis] = divmod(index, size)
  return dict(reversed(out.items()))


def _fail_slices(fn: str, groups: Groups, n: int, m: int, meta) -> np.int32:
  meta = np.asarray(meta)  # (devices, ..., 4, k * D)
  bad = _invalid(n, m)(meta)
  if not bad.any():
    return np.int32(0)
  device, i, fields = _first(bad, meta)
  in_off, size, out_off = (int(fields[f]) for f in (_IN_OFF, _SEND, _OUT_OFF))
  k = meta.shape[-1] // groups.size
  where = (
    f"{fn}: device {_coords(groups, device)}'s slice {i} (to group "
    f"position {i // k}): "
  )
  if size < 0:
    what = f"send_sizes[{i}] = {size} is negative"
  elif in_off < 0 or in_off > n - size:
    what = (
      f"input_offsets[{i}] = {in_off} and send_sizes[{i}] = {size} name "
      f"rows [{in_off}, {in_off + size}) of 'operand', which has {n}"
    )
  else:
    what = (
      f"output_offsets[{i}] = {out_off} and send_sizes[{i}] = {size} name "
      f"rows [{out_off}, {out_off + size}) of its receiver's 'output', "
      f"which has {m}"
    )
  raise launch_errors.remember(
    errors.OutOfBoundsError(
      f"{where}{what}: out of bounds (a TPU would fault; JAX leaves the "
      f"result undefined); {int(bad.sum())} slices leave their buffers"
    )
  )


def _fail_announced(fn: str, groups: Groups, both) -> np.int32:
  both = np.asarray(both)  # (devices, ..., 2, k * D)
  bad = _disagree(both)
  if not bad.any():
    return np.int32(0)
  receiver, i, fields = _first(bad, both)
  want, got = int(fields[0]), int(fields[1])
  k = both.shape[-1] // groups.size
  group = next(g for g in groups.members if receiver in g)
  sender, slot = divmod(i, k)
  why, error = (
    ("it would wait forever for rows never sent", errors.DeadlockError)
    if got > want
    else ("rows would arrive that it never waits for", errors.LeftoverError)
  )
  raise launch_errors.remember(
    error(
      f"{fn}: device {_coords(groups, receiver)} announces recv_sizes[{i}] "
      f"= {got} rows of slice {slot} from device "
      f"{_coords(groups, group[sender])}, which sends {want} (its "
      f"send_sizes[{group.index(receiver) * k + slot}]): on a TPU {why} "
      f"(JAX leaves the result undefined); {int(bad.sum())} of the "
      "announced sizes disagree"
    )
  )
