"""The lockstep path: SPMD collective kernels as XLA collectives.

A TPU kernel under ``jax.shard_map`` whose devices synchronise only through
remote DMAs, remote semaphore signals and the barrier semaphore, and issue
those unconditionally (straight-line code and loops of static trip count),
runs on every device as plain XLA: the kernel is discharged like on the
fast path, and each remote operation becomes an exchange (``all_gather``
over the shard_map's manual axes) at the point where every device issues
it. No Python runs per operation, unlike in the threaded TPU simulator.

Faithfulness. A DMA lands when it starts: a valid order of events for a
race-free kernel (races are the simulator's job: ``interpret=
pltpu.InterpretParams(detect_races=True)``). A wait that finds its
semaphore short would block on hardware; here the devices run in step, so
the semaphore is poisoned (set to the most negative count, and no later
signal lifts it) and the launch fails at the end with a ``DeadlockError``
naming device and semaphore, instead of running on with missing data.
Semaphores count elements as int16, as in Pallas' HLO interpreter.
"""

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd._jax import (
  callback,
  config,
  core,
  hlo_interpreter,
  mlir,
  pallas_core,
  pallas_primitives,
  sharding_impls,
  state_discharge,
  state_primitives,
  state_types,
  tree_util,
)
from mpmd.lowering import jaxpr_util, paths, watchdog
from mpmd.primitives import mpmd_map as prim

_POISON = int(jnp.iinfo(pallas_core.SEMAPHORE_INTERPRET_DTYPE).min)
_MAX_COUNT = int(pallas_core.SEMAPHORE_MAX_VALUE)
# Nesting under which devices may disagree on whether (or how often) an
# operation runs: an exchange there would leave the others waiting.
_DIVERGENT = ("cond", "while")


def manual_axes(axis_context: Any) -> tuple[Any, ...]:
  """The enclosing shard_map's manual axes, in mesh order (() if none)."""
  if not isinstance(axis_context, sharding_impls.SPMDAxisContext):
    return ()
  manual = axis_context.manual_axes
  return tuple(a for a in axis_context.mesh.axis_names if a in manual)


def _remote_target(eqn) -> Any:
  """The device_id of a remote DMA start / signal (None if local)."""
  name = eqn.primitive.name
  if name == "dma_start":
    return eqn.params["tree"].unflatten(eqn.invars)[-1]
  if name == "semaphore_signal":
    *_, device_id, _ = eqn.params["args_tree"].unflatten(eqn.invars)
    return device_id
  return None


def why_not(
  jaxprs: Sequence[core.Jaxpr], meshes: Sequence[Any], axes: tuple[Any, ...]
) -> str | None:
  """Why a synchronising kernel cannot run in lockstep (None if it can)."""
  if not axes:
    return "it is not inside jax.shard_map (no devices to exchange with)"
  if len(meshes) != 1 or math.prod(meshes[0].shape.values()) != 1:
    return "it runs several programs per device"

  def walk(jaxpr, enclosing):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "get_barrier_semaphore" and enclosing is not None:
        return f"it takes the barrier semaphore inside {enclosing}"
      if name == "semaphore_signal":
        *_, core_index = eqn.params["args_tree"].unflatten(eqn.invars)
        if core_index is not None:
          return "it signals another core's semaphore"
      if name == "dma_start" and eqn.params["add"]:
        target = _remote_target(eqn)
        if target is not None:
          return "it issues an accumulating remote DMA"
      target = _remote_target(eqn)
      if target is not None:
        if enclosing in _DIVERGENT:
          return f"it issues a remote {name} inside {enclosing}"
        if isinstance(target, dict):
          foreign = [a for a in target if a not in axes]
          if foreign:
            return (
              f"a remote {name} names axes {foreign} that are not manual "
              f"axes {axes} of the enclosing shard_map"
            )
        elif len(axes) != 1:
          return f"a remote {name} names its device by a flat id"
      for sub in jaxpr_util.sub_jaxprs(eqn.params):
        inner = enclosing if enclosing in _DIVERGENT else name
        reason = walk(sub, inner)
        if reason is not None:
          return reason
    return None

  return walk(jaxprs[0], None)


# -- semaphores that stay poisoned once a wait found them short ---------------


def _signal(sem: Any, inc: Any) -> None:
  """Adds ``inc`` to a semaphore, unless it is poisoned (negative)."""
  before = pallas_primitives.semaphore_read(sem)
  pallas_primitives.semaphore_signal(sem, jnp.where(before < 0, 0, inc))


def _wait(sem: Any, value: Any, decrement: bool = True) -> None:
  """Takes ``value`` from a semaphore, or poisons it if it holds less."""
  before = pallas_primitives.semaphore_read(sem).astype(jnp.int32)
  value = jnp.asarray(value, jnp.int32)
  after = before - value if decrement else before
  new = jnp.where(before < value, _POISON, after)
  # int16 arithmetic wraps, so this lands exactly on ``new``.
  pallas_primitives.semaphore_signal(sem, new - before)


def _count(ref: Any) -> int:
  """What a DMA of ``ref``'s shape adds to its semaphores."""
  return min(math.prod(ref.shape), _MAX_COUNT)


def _with_transforms(ref: Any, transforms: Any) -> Any:
  if not transforms:
    return ref
  return state_types.TransformedRef(ref, tuple(transforms))


def _split(ref: Any) -> tuple[Any, tuple[Any, ...]]:
  if isinstance(ref, state_types.TransformedRef):
    return ref.ref, ref.transforms
  return ref, ()


class _Devices:
  """The devices a kernel exchanges with: the shard_map's manual axes."""

  def __init__(self, axes: tuple[Any, ...], sizes: dict[Any, int]):
    self.axes = axes
    self.sizes = tuple(sizes[a] for a in axes)

  @property
  def count(self) -> int:
    return math.prod(self.sizes)

  def flat(self, device_id: Any) -> Any:
    """The flat index of ``device_id`` (a dict, or an index along the only
    axis); axes a dict leaves out keep this device's coordinate."""
    if not isinstance(device_id, dict):
      device_id = {self.axes[0]: device_id}
    index = jnp.int32(0)
    for a, size in zip(self.axes, self.sizes, strict=True):
      coord = device_id.get(a)
      coord = lax.axis_index(a) if coord is None else coord
      index = index * size + jnp.asarray(coord, jnp.int32)
    return index

  def me(self) -> Any:
    return self.flat({})

  def gather(self, tree: Any) -> Any:
    """Every device's ``tree``, stacked; static leaves are shared."""
    return tree_util.tree_map(
      lambda x: lax.all_gather(x, self.axes) if _traced(x) else None, tree
    )


def _traced(x: Any) -> bool:
  return isinstance(x, core.Tracer)


def _pick(leaves: list[Any], gathered: list[Any], j: int) -> list[Any]:
  return [
    x if g is None else g[j] for x, g in zip(leaves, gathered, strict=True)
  ]


def _remote_copy(devices: _Devices, src, dst, dst_sem, src_sem, device_id):
  data = state_primitives.ref_get(src, None)
  _signal(src_sem, _count(src))
  dst_ref, dst_transforms = _split(dst)
  sem_ref, sem_transforms = _split(dst_sem)
  leaves, tree = tree_util.tree_flatten((dst_transforms, sem_transforms))
  data_all, target_all, leaves_all = devices.gather(
    (data, devices.flat(device_id), leaves)
  )
  me = devices.me()
  for j in range(devices.count):
    dst_t, sem_t = tree_util.tree_unflatten(tree, _pick(leaves, leaves_all, j))

    def land(j=j, dst_t=dst_t, sem_t=sem_t):
      dst_j = _with_transforms(dst_ref, dst_t)
      state_primitives.ref_set(dst_j, None, data_all[j])
      _signal(_with_transforms(sem_ref, sem_t), _count(dst))

    lax.cond(target_all[j] == me, land, lambda: None)


def _remote_signal(devices: _Devices, sem, transforms, inc, device_id):
  leaves, tree = tree_util.tree_flatten(tuple(transforms))
  inc = jnp.asarray(inc, jnp.int32)
  target_all, inc_all, leaves_all = devices.gather(
    (devices.flat(device_id), inc, leaves)
  )
  me = devices.me()
  for j in range(devices.count):
    transforms_j = tree_util.tree_unflatten(tree, _pick(leaves, leaves_all, j))
    received = inc if inc_all is None else inc_all[j]
    _signal(
      _with_transforms(sem, transforms_j),
      jnp.where(target_all[j] == me, received, 0),
    )


def _rule(devices: _Devices, barrier: tuple[Any, ...]):
  """The rewrite of every synchronising operation (see module docstring)."""

  def rule(eqn, invals):
    name = eqn.primitive.name
    if name == "get_barrier_semaphore":
      return list(barrier)
    if name == "dma_start":
      src, dst, dst_sem, src_sem, device_id = eqn.params["tree"].unflatten(
        invals
      )
      if device_id is not None:
        _remote_copy(devices, src, dst, dst_sem, src_sem, device_id)
        return []
      data = state_primitives.ref_get(src, None)
      if eqn.params["add"]:
        data = data + state_primitives.ref_get(dst, None)
      state_primitives.ref_set(dst, None, data)
      _signal(dst_sem, _count(dst))
      return []
    if name == "dma_wait":
      # wait_send binds this with source and destination swapped, so the
      # semaphore and the buffer it counts are always the 2nd and 3rd.
      _, dst, dst_sem, _, _ = eqn.params["tree"].unflatten(invals)
      _wait(dst_sem, _count(dst))
      return []
    if name == "semaphore_signal":
      sem, transforms, inc, device_id, _ = eqn.params["args_tree"].unflatten(
        invals
      )
      if device_id is not None:
        _remote_signal(devices, sem, transforms, inc, device_id)
      else:
        _signal(_with_transforms(sem, transforms), inc)
      return []
    if name == "semaphore_wait":
      sem, transforms, value, decrement = eqn.params["args_tree"].unflatten(
        invals
      )
      _wait(_with_transforms(sem, transforms), value, decrement)
      return []
    return None

  return rule


def _barrier_avals(jaxpr: core.Jaxpr) -> list[Any]:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "get_barrier_semaphore":
      return [eqn.outvars[0].aval]
  return []


def _physical(aval: Any) -> Any:
  return hlo_interpreter._logical_aval_to_interpret_mode_aval(aval)


def _describe(aval: Any) -> str:
  kind = aval.inner_aval.dtype.name
  shape = aval.inner_aval.shape
  return f"{kind}{list(shape)}" if shape else kind


def lower(
  ctx: mlir.LoweringRuleContext, *in_nodes, kernel, axes, **params
) -> Sequence[Any]:
  """Lowers the launch for every device in step.

  ``kernel``: the launch's only jaxpr, aliased inputs already resolved to
  their outputs; ``axes``: the enclosing shard_map's manual axes.
  """
  [mesh] = params["meshes"]
  num_in, num_out = len(in_nodes), len(params["out_avals"])
  sizes = dict(ctx.module_context.axis_context.mesh.shape)
  devices = _Devices(axes, sizes)
  jaxpr = kernel
  barrier_avals = _barrier_avals(jaxpr)
  with prim.tracing_context(mesh, params["meshes"]):
    values = jaxpr_util.literal_axis_values(dict(mesh.shape), 0)
    jaxpr = jaxpr_util.rewrite_axis_indices(jaxpr, values.get, mesh.shape)
    # Semaphores as int16 counts, which plain signals may then update.
    jaxpr, consts = hlo_interpreter.resolve_physical_types(jaxpr, ())
    if consts:
      raise NotImplementedError("mpmd_map: kernel captured constants")
    jaxpr = jaxpr_util.rewrite_with_inputs(
      jaxpr,
      [_physical(a) for a in barrier_avals],
      functools.partial(_rule, devices),
    )
    program = state_discharge.discharge_state(core.ClosedJaxpr(jaxpr, ()))
  kernel_invars = [*params["jaxprs"][0].invars]
  scratch_avals = [v.aval for v in kernel_invars[num_in + num_out :]]
  names = [
    f"scratch {k} ({_describe(a)})"
    for k, a in enumerate(scratch_avals)
    if paths.is_semaphore(a)
  ] + ["the barrier semaphore"] * len(barrier_avals)
  semaphores = [
    num_in + num_out + k
    for k, a in enumerate(scratch_avals + barrier_avals)
    if paths.is_semaphore(a)
  ]
  run = functools.partial(
    _run,
    program=program,
    is_ref=[isinstance(v.aval, state_types.AbstractRef) for v in jaxpr.invars],
    num_in=num_in,
    num_out=num_out,
    out_sources={o: i for i, o in params["input_output_aliases"].items()},
    semaphores=semaphores,
    names=names,
    devices=devices,
  )
  # The kernel's values carry no varying-axes types: check none here.
  plain = [
    a.update(manual_axis_type=core.ManualAxisType()) for a in ctx.avals_in
  ]
  with config._check_vma(False):
    outs = mlir.lower_fun(run, multiple_results=True)(
      ctx.replace(avals_in=plain), *in_nodes
    )
  if ctx.tokens_out is None and ctx.tokens_in is not None:
    ctx.set_tokens_out(ctx.tokens_in)
  return outs


def _run(
  *args,
  program,
  is_ref,
  num_in,
  num_out,
  out_sources,
  semaphores,
  names,
  devices,
):
  def fresh(aval):
    return pallas_primitives.uninitialized_value(aval.shape, aval.dtype)

  avals = [v.aval for v in program.jaxpr.invars]
  operands = [
    *args,
    *(
      args[out_sources[o]] if o in out_sources else fresh(avals[num_in + o])
      for o in range(num_out)
    ),
    *map(fresh, avals[num_in + num_out :]),
  ]
  # The discharged program returns the final value of each Ref operand.
  updated = iter(core.eval_jaxpr(program.jaxpr, program.consts, *operands))
  final = [
    next(updated) if r else x for x, r in zip(operands, is_ref, strict=True)
  ]
  if semaphores:
    # Device 0 reports for all: one error per launch, not one per device.
    short = jnp.stack([jnp.any(final[k] < 0) for k in semaphores])
    callback.io_callback(
      functools.partial(_raise_if_short, names, devices),
      None,
      devices.me(),
      devices.gather(short),
    )
  return final[num_in : num_in + num_out]


def _raise_if_short(names, devices: _Devices, me, short) -> None:
  short = np.asarray(short)
  if int(me) != 0 or not short.any():
    return
  lines = []
  for flat, row in enumerate(short):
    coords = np.unravel_index(flat, devices.sizes)
    where = ", ".join(
      f"{a}={int(c)}" for a, c in zip(devices.axes, coords, strict=True)
    )
    waited = [name for name, s in zip(names, row, strict=True) if s]
    if waited:
      lines.append(f"  device ({where}) waits on {', '.join(waited)}")
  raise watchdog.DeadlockError(
    "mpmd_map deadlock: on the CPU lockstep path (devices run in step) "
    "these waits asked for more than had been signalled when every device "
    "had reached them, so on hardware they would wait forever:\n"
    + "\n".join(lines)
    + "\n(unless the devices must run out of step, which this path cannot "
    "show: pass interpret=pltpu.InterpretParams() to run the threaded TPU "
    "simulator)"
  )
