"""Warp maps (``pl.core_map`` / ``mpmd_map`` over a ``plgpu.WarpMesh``) in
the Mosaic GPU simulator of a jax that runs none.

A warp map forks the 4 warps of a warpgroup and joins them. jax 0.12's
simulator runs each warp as a thread; 0.10.2's raises "Higher-order
primitive core_map". There, the CPU fallback runs the warps one after
another, ``axis_index`` of the warp axis a literal in each: one order in
which the warps may run, so exact for warps that do not wait on each other.
Warps that synchronise (a barrier or a semaphore in the body) could wait
for a later warp, and the simulator keeps one barrier phase per warpgroup,
not per warp: those are refused with a clear error. The kernel still lowers
for CUDA.
"""

from typing import Any

import numpy as np

from mpmd import _jax
from mpmd import _warp_map as warp_map
from mpmd._jax import core, lax_parallel, pallas_core
from mpmd._lowering import jaxpr_util

NUM_WARPS = 4  # per warpgroup (Pallas' WarpMesh has the same)


def has_warp_map(jaxpr: core.Jaxpr) -> bool:
  return any(
    _jax.warp_map_parts(eqn, eqn.invars) is not None
    for eqn in jaxpr_util.iter_eqns(jaxpr)
  )


def _synchronises(body: core.Jaxpr) -> str | None:
  """What in a warp's body may wait on another warp (None: nothing)."""
  barrier_type = _jax.gpu().core.BarrierType
  for eqn in jaxpr_util.iter_eqns(body):
    if jaxpr_util.sub_jaxprs(eqn.params):
      continue  # its own equations name what they do
    for v in eqn.invars:
      dtype = getattr(getattr(v.aval, "inner_aval", v.aval), "dtype", None)
      if isinstance(dtype, barrier_type):
        return f"{eqn.primitive.name} uses a barrier"
      if dtype is not None and np.issubdtype(
        dtype, pallas_core.semaphore_dtype
      ):
        return f"{eqn.primitive.name} uses a semaphore"
  return None


def _warp_rule(axis_name: Any, warp: int):
  """Rewrites one warp's body: its warp index is ``warp``."""

  def rule(eqn, invals):
    del invals
    parts = _jax.warp_map_parts(eqn, eqn.invars)
    if parts is not None:
      raise ValueError(
        warp_map.nested_message(parts[-1], f" (over axis {axis_name!r})")
      )
    if eqn.primitive is lax_parallel.axis_index_p:
      names = eqn.params["axis_name"]
      names = names if isinstance(names, tuple) else (names,)
      if axis_name in names:
        if names != (axis_name,):
          raise NotImplementedError(
            f"mpmd_map: axis_index over {names} mixes the warp axis "
            f"{axis_name!r} with other axes; ask for each separately"
          )
        return [np.int32(warp)]
    return None

  return rule


def sequential_rule(eqn, invals):
  """A ``jaxpr_util`` rule: a warp map runs its warps one after another."""
  parts = _jax.warp_map_parts(eqn, invals)
  if parts is None:
    return None
  mesh, body, consts, args, _ = parts
  why = _synchronises(body)
  if why is not None:
    raise NotImplementedError(
      "mpmd_map: the CPU fallback on jax "
      f"{'.'.join(map(str, _jax.JAX_VERSION))} cannot run a warp map "
      f"(pl.core_map / mpmd_map over plgpu.WarpMesh(axis_name="
      f"{mesh.axis_name!r})) whose warps synchronise ({why}): this jax's "
      "Mosaic GPU simulator runs no warps of their own, and one warp "
      "after another may wait forever. The kernel still lowers for CUDA; "
      "jax >= 0.12 simulates the warps on CPU"
    )
  for warp in range(NUM_WARPS):
    jaxpr_util.eval_with_rule(
      body, consts, args, _warp_rule(mesh.axis_name, warp)
    )
  return []
