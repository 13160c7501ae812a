"""The checker's rules of loads and stores through Refs (``get``, ``swap``,
``addupdate`` and Pallas' masked ``load`` / ``swap``): each a plain function
of the program's context, the equation and its operands, returning the
outputs (none synchronises; ``interp`` registers them)."""

import numpy as np

from mpmd._jax import core
from mpmd._lowering.check import records


def _remembered(ctx, eqn, values, make):
  """``make()``, a function of ``eqn`` and integer scalar ``values`` (an
  unflattened pytree of indexers), made once per kernel for the same
  values: Pallas' pytree nodes cost far more to build than to look up.
  Other values are not remembered. A remembered tuple of views is a
  ``records.Views`` (a launch finds the window it cuts by its id)."""
  scalars = records.scalar_key(values)
  if scalars is None:
    return make()
  key = (eqn, *scalars)
  table = ctx.machine.plan.memo
  entry = table.get(key)
  if entry is None:
    made = make()
    if type(made) is tuple:
      made = records.Views(made)
    entry = made
    if len(table) < MAX_REMEMBERED:
      table[key] = entry
  return entry


# Entries ``_remembered`` keeps per kernel (past them, it makes anew).
MAX_REMEMBERED = 1 << 16


def _transforms(ctx, eqn, flat):
  tree = eqn.params["tree"]
  return _remembered(ctx, eqn, flat, lambda: tree.unflatten(flat))


def get(ctx, eqn, invals):
  ref, *flat = invals
  transforms = _transforms(ctx, eqn, flat)
  view = ctx.machine.view(ctx, ref, transforms, eqn)
  return [ctx.machine.load(ctx, view, eqn)]


def swap(ctx, eqn, invals):
  ref, value, *flat = invals
  transforms = _transforms(ctx, eqn, flat)
  view = ctx.machine.view(ctx, ref, transforms, eqn)
  old = ctx.machine.load(ctx, view, eqn, check_init=False, read=_used(eqn))
  ctx.machine.store(ctx, view, value, eqn)
  return [old]


def _used(eqn) -> bool:
  """Whether a swap's result (the values before its store) is used: most
  swaps are stores (``ref[...] = x``), whose old values are not read."""
  return not isinstance(eqn.outvars[0], core.DropVar)


def addupdate(ctx, eqn, invals):
  ref, value, *flat = invals
  transforms = _transforms(ctx, eqn, flat)
  view = ctx.machine.view(ctx, ref, transforms, eqn)
  old = ctx.machine.load(ctx, view, eqn)
  ctx.machine.store(ctx, view, np.asarray(old + np.asarray(value)), eqn)
  return []


def _masked_operands(ctx, eqn, ref, transforms, mask):
  """(view, mask as numpy) of a masked load / swap."""
  ref, own = records.split_ref(ref)
  view = ctx.machine.view(ctx, ref, (*own, *(transforms or ())), eqn)
  return view, None if mask is None else np.asarray(mask)


def masked_load(ctx, eqn, invals):
  ref, transforms, mask, other = eqn.params["args_tree"].unflatten(invals)
  view, mask = _masked_operands(ctx, eqn, ref, transforms, mask)
  value = ctx.machine.load(ctx, view, eqn, mask=mask)
  if mask is not None:
    fill = 0 if other is None else np.asarray(other)
    value = np.where(mask, value, fill).astype(value.dtype)
  return [value]


def masked_swap(ctx, eqn, invals):
  ref, transforms, value, mask = eqn.params["args_tree"].unflatten(invals)
  view, mask = _masked_operands(ctx, eqn, ref, transforms, mask)
  old = ctx.machine.load(ctx, view, eqn, check_init=False, read=_used(eqn))
  ctx.machine.store(ctx, view, value, eqn, mask=mask)
  return [old]
