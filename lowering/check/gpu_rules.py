"""Mosaic GPU equations -> the executor's GPU operations (``gpu``).

Each rule reads one equation's operands (by the primitive's parameters:
the transform trees, ``has_barrier``, ``has_user_predicate``) and yields a
synchronisation point, or acts at once where the operation only changes
the warpgroup's own state (``commit_group``, ``commit_smem``).
"""

from typing import Any

import numpy as np

from mpmd import _jax
from mpmd._jax import pallas_primitives, state
from mpmd._lowering import jaxpr_util
from mpmd._lowering.check import gpu, interp
from mpmd._lowering.check.interp import Sync


def _prims():
  return _jax.gpu().primitives


def _split(invals, *trees):
  """Operands after the leading Refs: one tuple of transforms per tree,
  then the rest."""
  out, k = [], 0
  for tree in trees:
    if tree is None:  # no transforms
      out.append(())
      continue
    n = tree.num_leaves
    out.append(tuple(tree.unflatten(invals[k : k + n])))
    k += n
  return out, invals[k:]


def _view(ctx, ref, transforms, what):
  describe = ctx.machine.describe(ctx, what, ctx.where)
  return ctx.machine.resolve(ref, transforms, describe)


def _skipped(eqn, rest) -> bool:
  """Whether a user predicate turned the operation off."""
  if eqn.params.get("has_user_predicate", False):
    return not bool(np.asarray(rest[-1]))
  return False


def _comp(ctx) -> int:
  return ctx.machine.comp(ctx.device, ctx.program)


def _copy_in(ctx, eqn, invals):
  p = eqn.params
  for name in ("collective_axes", "leader_tracked"):
    if p.get(name):
      raise NotImplementedError(
        f"mpmd checker: copy_gmem_to_smem({name}=...) (a copy across the "
        f"blocks of a cluster, at {ctx.where})"
      )
  if not p.get("has_barrier", True):
    raise NotImplementedError(
      "mpmd checker: copy_gmem_to_smem without a barrier (cp.async, "
      f"awaited by wait_gmem_to_smem, at {ctx.where})"
    )
  src, dst, barrier, *flat = invals
  (st, dt, bt), rest = _split(
    flat,
    p["src_transforms_treedef"],
    p["dst_transforms_treedef"],
    p["barrier_transforms_treedef"],
  )
  if _skipped(eqn, rest):
    return []
  what = "copy_gmem_to_smem"
  op = gpu.TmaLoad(
    _view(ctx, src, st, what),
    _view(ctx, dst, dt, what),
    _view(ctx, barrier, bt, what),
  )
  yield Sync(op, ctx.where)
  return []


def _copy_out(ctx, eqn, invals):
  p = eqn.params
  if p.get("reduction_op") is not None:
    raise NotImplementedError(
      "mpmd checker: copy_smem_to_gmem(reduction_op="
      f"{p['reduction_op']!r}) (at {ctx.where})"
    )
  src, dst, *flat = invals
  (st, dt), rest = _split(
    flat, p["src_transforms_treedef"], p["dst_transforms_treedef"]
  )
  if _skipped(eqn, rest):
    return []
  what = "copy_smem_to_gmem"
  op = gpu.TmaStore(
    _view(ctx, src, st, what),
    _view(ctx, dst, dt, what),
    bool(p.get("commit_group", True)),
  )
  yield Sync(op, ctx.where)
  return []


def _arrive(ctx, eqn, invals):
  barrier, *flat = invals
  (t,), rest = _split(flat, eqn.params["transforms_treedef"])
  if _skipped(eqn, rest):
    return []
  yield Sync(
    gpu.BarrierArrive(_view(ctx, barrier, t, "barrier_arrive")), ctx.where
  )
  return []


def _wait(ctx, eqn, invals):
  barrier, *flat = invals
  (t,), _ = _split(flat, eqn.params["transforms_treedef"])
  yield Sync(gpu.BarrierWait(_view(ctx, barrier, t, "barrier_wait")), ctx.where)
  return []


def _wait_stores(ctx, eqn, invals):
  # jax 0.12 has ``n`` as a parameter, 0.10.2 as the operand.
  n = eqn.params["n"] if "n" in eqn.params else invals[0]
  yield Sync(gpu.WaitStores(int(np.asarray(n))), ctx.where)
  return []


def _commit_group(ctx, eqn, invals):
  gpu.commit_group(ctx.machine.gpu.wg(_comp(ctx)))
  return []
  yield


def _commit_smem(ctx, eqn, invals):
  ctx.machine.gpu.fence(_comp(ctx))
  return []
  yield


def _wgmma(ctx, eqn, invals):
  p = eqn.params
  acc, a, b, *flat = invals
  (at, xt, yt), _ = _split(
    flat,
    p["acc_transforms_tree"],
    p["a_transforms_tree"],
    p["b_transforms_tree"],
  )
  views = [_view(ctx, r, t, "wgmma") for r, t in ((acc, at), (a, xt), (b, yt))]
  yield Sync(gpu.Wgmma(*views), ctx.where)
  return []


def _wgmma_wait(ctx, eqn, invals):
  n = eqn.params["n"] if "n" in eqn.params else invals[0]  # as above
  yield Sync(gpu.WgmmaWait(int(np.asarray(n))), ctx.where)
  return []


def _deref(ctx, eqn, invals):
  (acc,) = invals
  wait_n = eqn.params.get("wait_n")
  if wait_n is not None:
    yield Sync(gpu.WgmmaWait(int(wait_n)), ctx.where)
  view = _view(ctx, acc, (), "wgmma_accumulator_deref")
  return [ctx.machine.load(ctx, view, eqn)]


def _nothing(ctx, eqn, invals):
  return []
  yield


def _same(ctx, eqn, invals):
  # layout_cast: a register layout for the compiler; the values are equal.
  return [invals[0]]
  yield


_tpu_run_scoped = interp.RULES[pallas_primitives.run_scoped_p]


def _run_scoped(ctx, eqn, invals):
  from mpmd._lowering.check import gpu_machine

  if not isinstance(ctx.machine, gpu_machine.GpuMachine):
    return (yield from _tpu_run_scoped(ctx, eqn, invals))
  jaxpr = eqn.params["jaxpr"]
  collective = bool(eqn.params.get("collective_axes"))
  allocations = ctx.machine.allocate_scoped(ctx, eqn, jaxpr.invars, collective)
  ctx.scope_depth += 1
  try:
    return (yield from interp.run_jaxpr(ctx, jaxpr, invals, allocations))
  finally:
    ctx.scope_depth -= 1


def rules() -> dict[Any, Any]:
  g = _prims()
  return {
    g.copy_gmem_to_smem_p: _copy_in,
    g.copy_smem_to_gmem_p: _copy_out,
    g.barrier_arrive_p: _arrive,
    g.barrier_wait_p: _wait,
    g.wait_smem_to_gmem_p: _wait_stores,
    g.commit_group_p: _commit_group,
    g.commit_smem_p: _commit_smem,
    g.wgmma_ref_p: _wgmma,
    g.wgmma_wait_p: _wgmma_wait,
    g.wgmma_accumulator_deref_p: _deref,
    g.set_max_registers_p: _nothing,
    _jax.gpu().core.layout_cast_p: _same,
    pallas_primitives.run_scoped_p: _run_scoped,
  }


def install() -> None:
  """Adds the GPU rules to the executor's table (once; TPU kernels have
  none of these primitives, and run_scoped keeps its TPU rule there)."""
  interp.RULES.update(rules())


def unsupported(jaxpr) -> str | None:
  """The first operation of a GPU kernel the executor cannot run, named."""
  table = interp.RULES
  for eqn in jaxpr_util.iter_eqns(jaxpr):
    if eqn.primitive in table:
      continue
    if _jax.warp_map_parts(eqn, eqn.invars) is not None:
      return "a warp map (over a plgpu.WarpMesh)"
    if eqn.effects or any(
      isinstance(v.aval, state.AbstractRef) for v in eqn.invars
    ):
      return repr(eqn.primitive.name)
  return None
