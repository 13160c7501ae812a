"""Races the fast path can prove before it runs anything.

The fast path runs launches whose programs never wait on each other. Two
such programs of which one writes elements of a buffer they share (an
operand, HBM / ANY scratch, a SparseCore's VMEM_SHARED) and the other
reads them race on hardware: nothing orders them. Where both windows are
known when the launch is lowered (axis indices are then literals, and the
index arithmetic on them can be evaluated), :func:`find_race` names the
two accesses. Windows computed from data, or inside loops, are not looked
at: this check proves, it does not guess.
"""

import dataclasses
from typing import Any

import numpy as np

from mpmd import _jax, _pallas_ops
from mpmd._jax import (
  core,
  lax_control_flow,
  pjit,
  state,
  state_indexing,
  state_primitives,
)
from mpmd._lowering import errors, jaxpr_util
from mpmd._lowering.check import interp, memory, records, segments

_UNKNOWN = object()


@dataclasses.dataclass(frozen=True)
class Access:
  """A window of a shared buffer that a program reads or writes."""

  program: int
  operand: int
  ids: np.ndarray  # flat element indices
  write: bool
  where: str


class _Operand:
  """A stand-in buffer for ``memory.index_view`` (it reads the label)."""

  def __init__(self, k: int, shape):
    self.label = f"operand {k}"
    self.ids = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)


def accesses(jaxpr: core.Jaxpr, program: int, axis_values) -> list[Access]:
  """The accesses of one program whose windows are known statically."""
  found: list[Access] = []
  env: dict[core.Var, Any] = {}
  for k, v in enumerate(jaxpr.invars):
    if isinstance(v.aval, state.AbstractRef):
      inner = jaxpr_util.shaped(v.aval.inner_aval)
      env[v] = (k, _Operand(k, inner.shape))
  _walk(jaxpr, env, program, axis_values, found)
  return found


def _value(env, v):
  if isinstance(v, core.Literal):
    return v.val
  return env.get(v, _UNKNOWN)


def _walk(jaxpr, env, program, axis_values, found, outer: str = "") -> None:
  """``outer``: where the enclosing equation is in the user's code (the
  equations of a ``sync_copy``'s scope have no line of their own)."""
  for eqn in jaxpr.eqns:
    where = jaxpr_util.line(eqn) or outer
    ins = [_value(env, v) for v in eqn.invars]
    prim = eqn.primitive
    outs = None
    if prim is _jax.lax_parallel.axis_index_p:
      name = eqn.params["axis_name"]
      if name in axis_values:
        outs = [np.int32(axis_values[name])]
    elif prim in (
      state_primitives.get_p,
      state_primitives.swap_p,
      state_primitives.addupdate_p,
    ):
      _state_access(eqn, ins, program, found, where)
    elif _pallas_ops.kind(prim) is _pallas_ops.Sync.DMA_START:
      _dma_access(eqn, ins, program, found, where)
    elif prim is _jax.pallas_primitives.run_scoped_p:
      body = eqn.params["jaxpr"]
      inner = dict(zip(body.constvars, ins, strict=True))
      _walk(body, inner, program, axis_values, found, where)
    elif prim is lax_control_flow.cond_p and ins[0] is not _UNKNOWN:
      branch, _ = interp.opened(eqn.params["branches"][int(ins[0])])
      inner = dict(zip(branch.invars, ins[1:], strict=True))
      _walk(branch, inner, program, axis_values, found, where)
    elif prim is pjit.jit_p and not eqn.effects:
      outs = _evaluate(eqn, ins)
    elif not eqn.effects and not any(
      isinstance(v.aval, state.AbstractRef) for v in eqn.invars
    ):
      outs = _evaluate(eqn, ins)
    for v, x in zip(
      eqn.outvars, outs or [_UNKNOWN] * len(eqn.outvars), strict=True
    ):
      if not isinstance(v, core.DropVar):
        env[v] = x


def _evaluate(eqn, ins):
  """Index arithmetic on known scalars (anything else stays unknown)."""
  if any(x is _UNKNOWN or np.size(x) != 1 for x in ins):
    return None
  if any(getattr(v.aval, "shape", None) != () for v in eqn.outvars):
    return None
  try:
    return [np.asarray(x) for x in segments.bind_eqn(eqn, ins)]
  except Exception:  # noqa: BLE001 (what cannot be evaluated stays unknown)
    return None


def _window(ref, transforms, where):
  """(operand, flat ids) of a Ref operand's window, None if not known."""
  if ref is _UNKNOWN or not isinstance(ref, tuple):
    return None
  k, operand = ref
  view = memory.View(operand, operand.ids)
  for t in transforms:
    if not isinstance(t, state_indexing.NDIndexer):
      return None
    leaves = [
      i.start if isinstance(i, state_indexing.Slice) else i for i in t.indices
    ]
    if any(x is _UNKNOWN for x in leaves):
      return None
    try:
      view = memory.index_view(view, t, where)
    except errors.OutOfBoundsError:
      return None  # the bounds checks report it
  return k, view.ids.reshape(-1)


def _state_access(eqn, ins, program, found, where: str) -> None:
  ref, *rest = ins
  flat = rest if eqn.primitive is state_primitives.get_p else rest[1:]
  try:
    transforms = eqn.params["tree"].unflatten(flat)
  except Exception:  # noqa: BLE001 (unknown leaves: not statically known)
    return
  window = _window(ref, transforms, where)
  if window is not None:
    write = eqn.primitive is not state_primitives.get_p
    found.append(Access(program, *window, write, where))


def _dma_access(eqn, ins, program, found, where: str) -> None:
  try:
    dma = records.DmaStart.of(eqn, ins)
  except Exception:  # noqa: BLE001 (unknown leaves: not statically known)
    return
  if dma.device_id is not None:
    return  # another device's memory
  for operand, write in ((dma.src, False), (dma.dst, True)):
    window = _window(operand.ref, operand.transforms, where)
    if window is not None:
      found.append(Access(program, *window, write, where))


def find_race(per_program, shared, labels, names) -> str | None:
  """Raises ``RaceError`` where one program reads elements of a buffer that
  another writes; returns where two programs write the same elements
  (None if none do): a race unless they store the same bytes, which only
  the checking executor can tell.

  Args:
    per_program: each program's ``accesses``.
    shared: ``(program, operand) -> key``: equal keys are one buffer (None:
      the program's own).
    labels: per program, how messages name it.
    names: per program, how messages name each operand (its kernel's
      parameter names).
  """
  by_buffer: dict[Any, list[Access]] = {}
  for found in per_program:
    own: dict[Any, np.ndarray] = {}  # what this program wrote so far
    for a in found:
      key = shared(a.program, a.operand)
      if key is None:
        continue
      if a.write:
        own[key] = np.union1d(own.get(key, a.ids[:0]), a.ids)
      elif key in own:
        # It reads what it wrote itself (SPMD programs writing the same
        # values, then reading them back): that part is not another's.
        a = dataclasses.replace(a, ids=np.setdiff1d(a.ids, own[key]))
      by_buffer.setdefault(key, []).append(a)
  both_write = None
  for group in by_buffer.values():
    for i, a in enumerate(group):
      for b in group[i + 1 :]:
        if a.program == b.program or not (a.write or b.write):
          continue
        common = np.intersect1d(a.ids, b.ids)
        if not common.size:
          continue
        name = names[a.program][a.operand]
        if names[b.program][b.operand] != name:
          name += f" ({names[b.program][b.operand]} in {labels[b.program]})"
        if a.write and b.write:
          if both_write is None:
            both_write = (
              f"{labels[a.program]} at {a.where} and {labels[b.program]} "
              f"at {b.where} write {common.size} elements of {name} in "
              "common"
            )
          continue
        raise errors.RaceError(
          f"data race on {name}: {labels[a.program]} "
          f"{'writes' if a.write else 'reads'} it at {a.where} and "
          f"{labels[b.program]} {'writes' if b.write else 'reads'} it "
          f"at {b.where} ({common.size} elements in common), and no "
          "semaphore or DMA wait orders the two programs (they never "
          "wait on each other). Signal one from the other, or give "
          "each its own part of the buffer."
        )
  return both_write
