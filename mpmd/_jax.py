"""The one door to JAX internals.

jax-mpmd builds a JAX primitive and reuses Pallas' Mosaic / Mosaic GPU
lowerings and simulators, which only exist under ``jax._src``. Every such
import lives here, behind a check of the supported jax range (a version
outside it fails at import, clearly), with one shim per version difference.
"""

import dataclasses
import functools
import threading
import types
from typing import Any

import jax
import jaxlib

from mpmd._version import check_version, version_tuple

check_version("jax", jax.__version__)
check_version("jaxlib", jaxlib.__version__)
JAX_VERSION = version_tuple(jax.__version__)

# Before jaxlib 0.11, XLA copies a buffer that a lax.switch updates in
# place, whole, each time it runs (not a two-way cond): kernels that switch
# over branches writing a large buffer chain pl.when there (gmm's windows).
SWITCH_COPIES_UPDATED_BUFFERS = JAX_VERSION < (0, 11)

# jaxlib 0.10.2's XLA:CPU runs a dynamic update or slice of a 16-bit float
# buffer in f32, converting the whole buffer there and back each time (not
# later ones, nor as unsigned integers of the same width).
FLOAT16_DYNAMIC_OPS_CONVERT = JAX_VERSION < (0, 11)

# Upstream's mpmd_map gives an output declared in a kernel memory space
# (pltpu.SMEM(...), pltpu.VMEM(...) @ tc_mesh) a device array's type from
# 0.11 on (JAX outside a kernel rejects Pallas memory spaces); 0.10 keeps
# it, which Mosaic reads as the buffer's colour in a later launch's Ref.
OUTPUTS_LEAVE_AS_DEVICE_ARRAYS = JAX_VERSION >= (0, 11)

# A simulator launch runs each device's simulation as a computation of its
# own, from one host callback per device (lowering/watchdog.py). On 0.10 it
# would wait for a thread of XLA:CPU's pool that the callers hold (8
# devices, 256 KiB buffers hung): it stays in the caller's (drop with 0.10).
SIMULATE_DEVICES_AS_COMPUTATIONS = JAX_VERSION >= (0, 11)

# ruff: noqa: E402, F401, I001
from jax._src import api_util
from jax._src import callback
from jax._src import checkify as checkify_internal
from jax._src import config
from jax._src import core
from jax._src import custom_derivatives
from jax._src import dispatch
from jax._src import effects
from jax._src import linear_util as lu
from jax._src import mesh as mesh_lib
from jax._src import pjit
from jax._src import sharding_impls
from jax._src import source_info_util
from jax._src import state
from jax._src import tree_util
from jax._src import util
from jax._src.frozen_dict import FrozenDict
from jax._src import ad_util
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import control_flow as lax_control_flow
from jax._src.lax import parallel as lax_parallel
from jax._src.pallas import core as pallas_core
from jax._src.pallas import pallas_call
from jax._src.pallas import primitives as pallas_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types
from jax._src.pallas import hlo_interpreter


@functools.cache
def tpu():
  """Pallas TPU (Mosaic) internals, imported on first use."""
  try:
    from jax._src.pallas.mosaic import core as tpu_core
    from jax._src.pallas.mosaic import pallas_call_registration
    from jax._src.pallas.mosaic import primitives as tpu_primitives
    from jax._src.pallas.mosaic import tpu_info as pallas_tpu_info

    if JAX_VERSION >= (0, 11):  # moved; Pallas' module re-exports its names
      # pyrefly: ignore[missing-module-attribute]  # not in jax < 0.11
      from jax._src import tpu_info
    else:
      tpu_info = pallas_tpu_info
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic.interpret import params as interpret_params
    from jax._src.pallas.mosaic.interpret import shared_memory
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError as e:
    raise ImportError(
      "jax-mpmd: the Pallas TPU backend is missing from this jaxlib; "
      "install jax-mpmd[tpu]"
    ) from e
  return types.SimpleNamespace(
    core=tpu_core,
    registration=pallas_call_registration,
    primitives=tpu_primitives,
    info=tpu_info,
    # Where Pallas looks up the TPU hardware queries (by module attribute).
    info_modules=tuple(
      {id(m): m for m in (tpu_info, pallas_tpu_info)}.values()
    ),
    interpret=interpret_params,
    simulator=interpret_pallas_call,
    simulator_memory=shared_memory,
    simulator_threads=thread_map,
  )


def is_extended(dtype) -> bool:
  """A JAX extended dtype (PRNG keys, ...): no numpy equivalent."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _fuser():
  """The Pallas fuser's dtypes module, imported on first use."""
  from jax._src.pallas.fuser import fusible_dtype

  return fusible_dtype


def register_physicalize_rule(primitive, rule) -> None:
  """Registers ``rule(ctx, *args, **params)`` as ``primitive``'s rule for
  the Pallas fuser's ``physicalize`` (which replaces fusion dtypes by their
  physical parts), as upstream registers one for its mpmd_map. Both ends
  of our range have the fuser's rule table (jax 0.10.2, 0.12)."""
  _fuser()._physicalize_rules[primitive] = rule


def physicalize_jaxpr(jaxpr):
  """``jaxpr`` (no constvars) with fusion dtypes replaced by their parts."""
  return _fuser().physicalize_jaxpr(jaxpr)


def is_fusion_dtype(dtype: Any) -> bool:
  """A Pallas fuser dtype (``FusionDType``, what ``fuser.physicalize``
  resolves); the fuser is imported only for extended dtypes."""
  if dtype is None or not is_extended(dtype):
    return False
  return isinstance(dtype, _fuser().FusionDType)


@functools.cache
def gpu():
  """Pallas Mosaic GPU internals, imported on first use."""
  try:
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import pallas_call_registration
    from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
  except ImportError as e:
    raise ImportError(
      "jax-mpmd: the Pallas Mosaic GPU backend is missing from this "
      "jaxlib; install jax-mpmd[cuda]"
    ) from e
  return types.SimpleNamespace(
    core=gpu_core,
    registration=pallas_call_registration,
    primitives=gpu_primitives,
    interpret=interpret_params,
    simulator=interpret_pallas_call,
    simulator_callbacks=gpu_callbacks,
    simulator_memory=shared_memory,
  )


# -- what differs between supported versions ----------------------------------


def tensorcore_mesh(axis_name: str, num_cores: int):
  """A Pallas ``TensorCoreMesh`` of ``num_cores`` cores. 0.11 made the mesh
  a dataclass of ``(axis_name, num_cores)`` and deprecated
  ``create_tensorcore_mesh``, which is all 0.10.2 has."""
  tpu_core = tpu().core
  if JAX_VERSION >= (0, 11):
    return tpu_core.TensorCoreMesh(axis_name=axis_name, num_cores=num_cores)
  return tpu_core.create_tensorcore_mesh(axis_name, num_cores=num_cores)


def register_dce_rule(prim: core.Primitive, rule) -> None:
  """Registers ``rule(used_outs, eqn) -> (used_ins, eqn | None)``.

  0.12 calls DCE rules with the liveness of Ref inputs in between.
  """
  if JAX_VERSION >= (0, 12):
    # pyrefly: ignore[unsupported-operation]  # this signature: jax >= 0.12
    pe.dce_rules[prim] = lambda used_outs, live_ins, eqn: rule(used_outs, eqn)
  else:
    pe.dce_rules[prim] = rule


def register_discharge_rule(prim: core.Primitive, rule) -> None:
  """Registers ``rule(in_avals, out_avals, *args, **params)``.

  0.11 passes a ``DischargeContext`` instead of the two aval lists.
  """
  if JAX_VERSION >= (0, 11):

    def ctx_rule(ctx, *args, **params):
      return rule(ctx.in_avals, ctx.out_avals, *args, **params)

    state_discharge.register_discharge_rule(prim)(ctx_rule)
  else:
    state_discharge.register_discharge_rule(prim)(rule)


def closed_jaxpr(jaxpr: core.Jaxpr, consts=()):
  """``jaxpr`` closed over ``consts``: a ``ClosedJaxpr`` up to 0.10, a
  ``Jaxpr`` with its consts attached from 0.11 on (``ClosedJaxpr`` is gone)."""
  if JAX_VERSION >= (0, 11):
    # pyrefly: ignore[missing-attribute]  # jax >= 0.11 only
    return jaxpr.with_consts(consts) if consts else jaxpr
  # pyrefly: ignore[missing-attribute]  # jax < 0.11 only
  return core.ClosedJaxpr(jaxpr, consts)


def open_jaxpr(j) -> tuple[core.Jaxpr, list]:
  """``(jaxpr, consts)`` of a jaxpr in an equation's params, closed or not.

  From 0.11 on the jaxpr itself carries its consts, as values (a closed
  jaxpr) or as the equation's operands (``run_scoped``).
  """
  if JAX_VERSION >= (0, 11):
    return j, list(j.consts)
  # pyrefly: ignore[missing-attribute]  # jax < 0.11 only
  if isinstance(j, core.ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


def is_jaxpr(value) -> bool:
  """A jaxpr of an equation's params, closed or not."""
  if JAX_VERSION >= (0, 11):
    return isinstance(value, core.Jaxpr)
  # pyrefly: ignore[missing-attribute]  # jax < 0.11 only
  return isinstance(value, (core.Jaxpr, core.ClosedJaxpr))


def is_closed(j) -> bool:
  """Whether a params jaxpr is closed over values (a loop body or cond
  branch), as opposed to a scope whose constvars are the equation's operands
  (``run_scoped``; from 0.11 on, tell them apart by the primitive)."""
  if JAX_VERSION >= (0, 11):
    return True
  # pyrefly: ignore[missing-attribute]  # jax < 0.11 only
  return isinstance(j, core.ClosedJaxpr)


def discharge_state(j, **kwargs):
  """``discharge_state`` that drops Pallas memory spaces like 0.10 did."""
  if JAX_VERSION >= (0, 11):
    kwargs.setdefault("strip_memory_space", True)
  return state_discharge.discharge_state(j, **kwargs)


def scope_jaxpr(jaxpr: core.Jaxpr, num_closed: int, operands) -> core.Jaxpr:
  """A ``run_scoped`` body from ``jaxpr`` whose first ``num_closed`` inputs
  are the closed-over refs, passed to the equation as ``operands``.

  Up to 0.10 they are the body's bare constvars; from 0.11 on they are
  constvars with the operands attached (``run_scoped_p.bind(*jaxpr.consts)``).
  """
  if JAX_VERSION >= (0, 11):
    # pyrefly: ignore[missing-attribute]  # jax >= 0.11 only
    return jaxpr.with_consts(list(operands)[:num_closed])
  return jaxpr.replace(
    constvars=jaxpr.invars[:num_closed], invars=jaxpr.invars[num_closed:]
  )


def replace_jaxpr(jaxpr: core.Jaxpr, **changes) -> core.Jaxpr:
  """``jaxpr.replace(**changes)`` that keeps attached consts (0.11+ drops
  them when ``constvars`` is replaced)."""
  if JAX_VERSION >= (0, 11) and "constvars" in changes:
    # pyrefly: ignore[missing-attribute]  # jax >= 0.11 only
    changes.setdefault("consts", jaxpr.consts)
  return jaxpr.replace(**changes)


def scan_layout(params) -> tuple[int, int]:
  """(consts, carries) of a ``scan`` equation's operands, which its body
  takes in the same order (then the scanned slices). Up to 0.11 they are
  counts among the params; 0.12 packs them in a flat tree (``ft_in``)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  layout = params["ft_in"]
  consts, carry, _ = layout.update(list(range(len(layout)))).unpack()
  return len(list(consts)), len(list(carry))


def scan_with_consts(params, num_consts: int) -> dict[str, Any]:
  """A scan's params with ``num_consts`` constants (its carry and scanned
  operands as they are): counts up to 0.11, ``ft_in`` from 0.12."""
  if "num_consts" in params:
    return dict(params, num_consts=num_consts)
  # pyrefly: ignore[missing-module-attribute]  # not in jax < 0.11
  from jax._src import flattree

  _, carry, xs = params["ft_in"].unpack()
  ft_in = flattree.pack((flattree.nones(num_consts), carry, xs))
  return dict(params, ft_in=ft_in)


def ref_indexings(traceback) -> list[tuple[Any, tuple[Any, ...]]]:
  """The ``ref.at[indices]`` calls an exception's ``traceback`` passes
  through, innermost first: (the Ref or view indexed, its indices). Empty
  where JAX's ``RefIndexer.__getitem__`` no longer names them so."""
  code = state_types.RefIndexer.__getitem__.__code__
  found = []
  while traceback is not None:
    frame = traceback.tb_frame
    if frame.f_code is code:
      local = frame.f_locals
      indexer, indices = local.get("self"), local.get("slc")
      view = getattr(indexer, "ref_or_view", None)
      if view is not None and indices is not None:
        indices = indices if isinstance(indices, tuple) else (indices,)
        found.append((view, indices))
    traceback = traceback.tb_next
  return found[::-1]


def dma_flatten(src, dst, sem, send_sem, device_id):
  """(flat operands, tree) of a DMA, as Pallas flattens them (by its own
  tracing registry on 0.12)."""
  return tpu().primitives._dma_flatten(src, dst, sem, send_sem, device_id)


@functools.cache
def sparsecore_primitives():
  """Pallas' SparseCore primitives (its subcore barrier, fetch-and-add)."""
  from jax._src.pallas.mosaic import sc_primitives

  return sc_primitives


# -- Mosaic GPU differences ---------------------------------------------------


def lower_mosaic_gpu(ctx, *in_nodes, mesh, jaxpr, grid_mapping, **params):
  """Lowers one Mosaic GPU mesh kernel with Pallas' own lowering.

  ``jaxpr`` takes the inputs then the outputs, nothing else: its scratch is
  allocated inside it (a collective ``run_scoped``). 0.10 lowers it as a
  ``pallas_call`` over ``mesh`` (``grid_mapping`` describes the operands);
  0.11 removed that entry point and lowers mesh kernels through its own
  ``mpmd_map`` rule, which takes no scratch operands. ``params``: the rest
  of ``pallas_call``'s lowering params.
  """
  registration = gpu().registration
  if JAX_VERSION >= (0, 11):
    aliases = FrozenDict(dict(params.pop("input_output_aliases")))
    return registration.mpmd_map_mgpu_lowering_rule(
      ctx,
      *in_nodes,
      meshes=(mesh,),
      jaxprs=(jaxpr,),
      input_output_aliases=aliases,
      interpret=False,
      external_meshes=(),
      **params,
    )
  return registration.pallas_call_lowering(
    ctx,
    *in_nodes,
    mesh=mesh,
    jaxpr=jaxpr,
    grid_mapping=grid_mapping,
    interpret=False,
    **params,
  )


def gpu_barrier_waiter(args, kwargs) -> tuple[int, int, object]:
  """``(device id, program in the block, logging info)`` of a call
  ``Barrier.wait(*args, **kwargs)`` in the Mosaic GPU simulator. 0.10
  passes the ids (``device_id, local_thread_id, logging_info``); 0.11 the
  waiting warpgroup (or warp) object (``thread, logging_info``)."""
  if JAX_VERSION >= (0, 11):
    thread, *rest = args or (kwargs["thread"],)
    device, program = thread.device_id, thread.warpgroup_id
  else:
    device, program, *rest = args
  logging_info = rest[0] if rest else kwargs.get("logging_info")
  return int(device), int(program), logging_info


def abort_gpu_barrier(barrier) -> None:
  """Ends every wait on a Mosaic GPU simulator ``barrier``: each waiter
  raises (the launch has failed; its barriers are not used again). 0.11
  aborts a barrier (``Barrier.abort``); 0.10's waiters raise once the
  barrier's phase is past the one they await (drop with jax 0.10)."""
  if JAX_VERSION >= (0, 11):
    barrier.abort()
    return
  with barrier.cv:
    barrier.phase = max(barrier.next_awaited_phase_by_thread, default=0) + 1
    barrier.cv.notify_all()


# -- TPU simulator differences ------------------------------------------------


def fail_tpu_simulation(memory, error: Exception, device: int, core: int):
  """Fails a TPU simulation from inside one program's thread (0.11 names
  the failed thread instead of its device and core)."""
  if JAX_VERSION >= (0, 11):
    memory.set_failed(
      error, failed_thread=f"device {device} core {core}", top_level=False
    )
  else:
    memory.set_failed(error, device, core, top_level=False)


def race_params(params):
  """``(params to run a simulator with, whether a race is an error)``.

  0.12 added ``on_race`` (default ``"raise"``) to both simulators, whose
  detector then raises inside a program's thread (an opaque runtime error).
  We run with ``"warn"``, which only records races, and raise our own error
  after the launch; a user's ``on_race="warn"`` only warns. Earlier
  versions only record races."""
  if not getattr(params, "detect_races", False):
    return params, True
  on_race = getattr(params, "on_race", "raise")
  if on_race == "raise" and JAX_VERSION >= (0, 12):
    params = dataclasses.replace(params, on_race="warn")
  return params, on_race == "raise"


# -- private JAX names, each behind one accessor -------------------------------


def no_vma_check():
  """A context in which JAX does not check varying manual axes (vma):
  kernels are traced, and simulators evaluated, without it."""
  return config._check_vma(False)


def vma_checked() -> bool:
  """Whether JAX checks varying manual axes here (``shard_map(check_vma=)``)."""
  return config._check_vma.value


def out_shape_to_aval(out_shape):
  """Pallas' aval of one ``out_shape`` entry (a ShapeDtypeStruct or a
  memory-space-annotated type)."""
  return pallas_core._convert_out_shape_to_aval(out_shape)


def interpret_mode_aval(aval):
  """The aval the HLO interpreter uses for a kernel operand's aval."""
  return hlo_interpreter._logical_aval_to_interpret_mode_aval(aval)


def ordered_io_effect():
  """The effect of an ordered ``io_callback``."""
  return callback._OrderedIOEffect


def tracer_trace(tracer: core.Tracer):
  """The trace a tracer belongs to."""
  return tracer._trace


def scan_counts(params) -> tuple[int, int]:
  """(consts, carries) of a ``scan``'s operands (0.12: from ``ft_in``)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def checkify_check(error) -> tuple[Any, Any, list]:
  """(predicate, ``FailedCheckError`` tree, its leaves) of a checkify
  ``Error`` of one check (``check_p``'s operands)."""
  p, m, d = error._pred, error._metadata, error._payload
  [check] = zip(p.values(), m.values(), d.values(), strict=True)
  return check


def tpu_simulator_memory():
  """The TPU simulator's state of the launch it runs (None between runs)."""
  return tpu().simulator._shared_memory


def tpu_simulator_failure() -> BaseException | None:
  """What made the TPU simulator's last launch fail, if it kept it."""
  memory = tpu_simulator_memory()
  return None if memory is None else memory._failure


def fail_tpu_simulator_device(error: Exception, device_id: int) -> None:
  """Ends device ``device_id``'s part of the TPU simulator's launch as
  failed, as its own failure would (the other devices stop waiting for it).
  Used on 0.10 only (``SIMULATE_DEVICES_AS_COMPUTATIONS``)."""
  if tpu_simulator_memory() is not None:
    try:
      tpu().simulator.fail(error, device_id)
    except threading.BrokenBarrierError:
      pass  # the clean-up was released (release_tpu_simulator_clean_up)


def release_tpu_simulator_clean_up() -> None:
  """Lets the devices of the TPU simulator's failed launch end without
  those that never began it: the clean-up after a failure, which waits for
  every device, raises now instead (the next launch starts afresh)."""
  memory = tpu_simulator_memory()
  if memory is not None:
    memory.clean_up_barrier.abort()


def gpu_simulator_races_found() -> bool:
  """Whether the Mosaic GPU simulator's race detector found a race."""
  races = gpu().simulator_callbacks._races
  return races is not None and races.races_found


# -- warp maps: Pallas' fork over the warps of a Mosaic GPU warpgroup ---------


def is_warp_mesh(mesh: pallas_core.Mesh) -> bool:
  """Whether ``mesh`` is a ``plgpu.WarpMesh`` (the warps of a warpgroup)."""
  try:
    return isinstance(mesh, gpu().core.WarpMesh)
  except ImportError:  # no Mosaic GPU backend: no such meshes
    return False


# 0.12's Mosaic GPU simulator runs each warp of a warp map as a thread of its
# own; 0.10.2's runs none (it raises "Higher-order primitive core_map").
GPU_SIMULATOR_RUNS_WARP_MAPS = JAX_VERSION >= (0, 12)
# 0.12's skips plgpu.layout_cast (values keep their logical layout there);
# 0.10.2's has no rule for it ("MLIR translation rule ... not found").
GPU_SIMULATOR_RUNS_LAYOUT_CASTS = JAX_VERSION >= (0, 12)


def bind_warp_map(mesh: pallas_core.Mesh, fn) -> None:
  """Binds Pallas' own warp map of ``fn()`` over ``mesh`` (a WarpMesh), as
  ``pl.core_map(mesh)(fn)`` does: 0.10.2 binds its ``core_map`` primitive,
  later versions (which removed it) their ``mpmd_map`` primitive, which the
  Mosaic GPU lowering and simulator know."""
  if hasattr(pallas_core, "core_map_p"):
    pallas_core.core_map(mesh)(fn)
  else:
    from jax._src.pallas import mpmd as pallas_mpmd

    pallas_mpmd._mpmd_map([(mesh, fn)])()


def warp_map_parts(eqn, invals):
  """``(mesh, body, consts, args, primitive name)`` of a warp-map equation
  (``core_map`` or Pallas' ``mpmd_map`` over one WarpMesh), evaluated as
  ``core.eval_jaxpr(body, consts, *args)``; None for other equations."""
  core_map_p = getattr(pallas_core, "core_map_p", None)
  if core_map_p is not None and eqn.primitive is core_map_p:
    mesh = eqn.params["mesh"]
    if is_warp_mesh(mesh):
      return mesh, eqn.params["jaxpr"], list(invals), [], "core_map"
    return None
  if eqn.primitive.name != "mpmd_map" or "jaxprs" not in eqn.params:
    return None
  from jax._src.pallas import mpmd as pallas_mpmd

  if eqn.primitive is not pallas_mpmd.mpmd_map_p:
    return None
  meshes, jaxprs = eqn.params["meshes"], eqn.params["jaxprs"]
  if len(meshes) != 1 or not is_warp_mesh(meshes[0]):
    return None
  body, consts = open_jaxpr(jaxprs[0])
  return meshes[0], body, list(consts), list(invals), "mpmd_map"


# jax 0.10's CPU client runs a multi-device program's host callbacks on the
# thread pool that runs its computations: while every device's callback
# holds a thread of it, a computation dispatched from inside one of them
# may never get one (seen at 4 devices and more). Drop with jax 0.10.
CALLBACKS_FILL_POOL = JAX_VERSION < (0, 11)


def xla_client_parts():
  """``(compiler, xla_client)``: what compiling for a CPU client of our
  own takes (``lowering/check/host_client.py``)."""
  from jax._src import compiler
  from jax._src.lib import xla_client

  return compiler, xla_client
