"""A launch on the checking executor: its lowering and its host callback.

The CPU lowering emits one host callback for the whole launch. Under a
``shard_map`` every device gathers all devices' inputs first (an XLA
all-gather), so that the callback, whichever device runs it first, holds
every device's inputs and runs *all* their programs in one machine; the
others find its results (or its error) waiting, keyed by their inputs. No
device waits for another inside the callback, so nothing there can hang.
Each device's callback also gets its position, and returns only its own
outputs (not all devices' stacked, which every device would copy).
"""

import contextlib
import gc
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

from mpmd import _jax
from mpmd._jax import mlir
from mpmd._lowering import callbacks, common, errors, merge, paths
from mpmd._lowering.check import machine, sync
from mpmd._lowering.check.params import Run


def _program_names(meshes) -> tuple[str, ...]:
  names = []
  for i, mesh in enumerate(meshes):
    shape = dict(mesh.shape)
    sizes = list(shape.values())
    for flat in range(int(np.prod(sizes, dtype=np.int64))):
      coords = np.unravel_index(flat, sizes) if sizes else ()
      where = {a: int(c) for a, c in zip(shape, coords, strict=True)}
      names.append(f"mesh {i} program {where}")
  return tuple(names)


def _labels(jaxprs, count: int) -> tuple[str, ...]:
  names = getattr(jaxprs[0].debug_info, "arg_names", None) or ()
  labels = []
  for k in range(count):
    name = names[k] if k < len(names) and names[k] else None
    labels.append(name or f"operand {k}")
  return tuple(labels)


def kernel_name(params) -> str:
  if params.get("name"):
    return params["name"]
  infos = [str(j.debug_info.func_src_info) for j in params["jaxprs"]]
  return " + ".join(infos)


def plan_of(params, device_axes) -> machine.Plan:
  """The executor's view of a launch: its kernels merged into one kernel
  over all programs (``merge``), its devices, and names for messages."""
  meshes = params["meshes"]
  if any(paths.is_gpu_mesh(m) for m in meshes):
    from mpmd._lowering.check import gpu_launch

    return gpu_launch.plan_of(
      params,
      device_axes,
      kernel=kernel_name(params),
      labels=lambda j: _labels(params["jaxprs"], len(j.invars)),
    )
  num_in = params["num_inputs"]
  _, jaxpr, _ = merge.merge_for_tpu(params)
  num_operands = num_in + len(params["out_avals"])
  if paths.semaphore_operands(jaxpr, num_operands):
    raise NotImplementedError(
      "mpmd checker: semaphores as inputs or outputs of a launch (counts "
      "carried from one launch to the next)"
    )
  return machine.Plan(
    jaxpr=jaxpr,
    num_in=num_in,
    out_avals=tuple(params["out_avals"]),
    aliases={o: i for i, o in params["input_output_aliases"].items()},
    device_axes=tuple(device_axes),
    super_axis=merge.SUPER_AXIS,
    program_names=_program_names(meshes),
    kernel=kernel_name(params),
    labels=_labels(params["jaxprs"], len(jaxpr.invars)),
  )


class Launch:
  """The host side of one lowered launch: runs it, once per call."""

  def __init__(self, plan: machine.Plan, check):
    self.plan = plan
    self.check = check
    self.lock = threading.Lock()
    # Results other devices of the same call have not taken yet:
    # [token, inputs, result, devices still to take it].
    self.waiting: list[list[Any]] = []

  def __call__(self, *inputs):
    devices = self.plan.num_devices
    token = self.check.token()
    # Under shard_map the last input is the calling device's position.
    mine = None
    if self.plan.device_axes:
      *inputs, position = inputs
      mine = int(position)
    # (ascontiguousarray makes a 0-d input 1-d: for comparing only.)
    flat = tuple(np.ascontiguousarray(x) for x in inputs)
    with self.lock:
      for k, entry in enumerate(self.waiting):
        if entry[0] == token and _same(entry[1], flat):
          entry[3] -= 1
          if entry[3] == 0:
            del self.waiting[k]
          return _deliver(entry[2], mine)
      result = self._run(inputs)
      if devices > 1:
        self.waiting.append([token, flat, result, devices - 1])
      return _deliver(result, mine)

  def _run(self, inputs):
    # The collector stays off until the machine is gone: its objects,
    # which hold no reference cycle, are freed by refcounting as
    # ``_launch`` returns, and the collector never walks them.
    with _COLLECTOR.paused():
      return self._launch(inputs)

  def _launch(self, inputs):
    run: Run = self.check.begin_launch()
    m, execute = _machine(self.plan, run.strategy(self.plan))
    try:
      outs = execute(inputs)
    except errors.LaunchError as e:
      error = _with_schedule(e, run.text, self.plan.identical_writes_race)
      run.finish(m, error)
      return error
    except Exception as e:  # noqa: BLE001 (the launch's own failure)
      run.finish(m, e)
      return e
    finally:
      m.release()
    run.finish(m, None)
    return outs


class _Collector:
  """Python's cyclic garbage collector, paused while any checked launch
  runs (``paused``). It is one switch for the process, so launches from
  several threads share one pause: the first one in turns it off (if it
  was on), the last one out turns it back on. Why pause: a launch makes
  and drops hundreds of thousands of small objects, which refcounting
  frees; they trigger collections all the same, and the full ones walk the
  whole process (500K objects of JAX and the user's): a third of a D=8
  ring launch's time went there. A launch that ends without error leaves
  no cycle (its machine is freed by refcounting before the collector is
  back on); a failed one's (the error's traceback) are collected later, as
  any other garbage."""

  def __init__(self):
    self._lock = threading.Lock()
    self._running = 0
    self._was_enabled = False

  @contextlib.contextmanager
  def paused(self):
    with self._lock:
      if self._running == 0:
        self._was_enabled = gc.isenabled()
        gc.disable()
      self._running += 1
    try:
      yield
    finally:
      with self._lock:
        self._running -= 1
        if self._running == 0 and self._was_enabled:
          gc.enable()


_COLLECTOR = _Collector()


def _same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
  """Whether two calls' inputs are the same bytes (one call's devices
  gather the same inputs; comparing them costs a fraction of hashing)."""
  return all(
    x.dtype == y.dtype
    and x.shape == y.shape
    and np.array_equal(_words(x), _words(y))
    for x, y in zip(a, b, strict=True)
  )


def _words(x: np.ndarray) -> np.ndarray:
  """A contiguous array's bytes, as 8-byte words where they divide it
  (fewer elements to compare)."""
  flat = x.reshape(-1).view(np.uint8)
  return flat.view(np.uint64) if flat.size % 8 == 0 else flat


def _machine(plan: machine.Plan, strategy):
  """The launch's machine, and its scheduling loop (GPU launches have one
  of their own, over warpgroups, TMA copies and WGMMAs)."""
  from mpmd._lowering.check import gpu_launch, gpu_machine

  if isinstance(plan, gpu_machine.GpuPlan):
    gpu = gpu_machine.GpuMachine(plan, strategy)
    return gpu, lambda inputs: gpu_launch.run(gpu, inputs)
  m = machine.Machine(plan, strategy)
  return m, lambda inputs: sync.run(m, inputs)


def _with_schedule(
  error: errors.LaunchError, text: str, identical_writes_race: bool = True
):
  """The error, saying which schedule produced it and how to rerun it."""
  option = "" if identical_writes_race else ", identical_writes_race=False"
  again = type(error)(
    f"{error}\n(schedule {text!r}: mpmd.replay(f, *args, schedule={text!r})"
    f", or interpret=mpmd.CheckParams(schedule={text!r}{option}) on the "
    "launch, runs it again)"
  )
  again.schedule = text
  return again


def _deliver(result, device: int | None):
  """The outputs of ``device`` (of the only one if None), or the error."""
  if isinstance(result, BaseException):
    raise result
  return result[0 if device is None else device]


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, path, **params):
  """The CPU lowering of a launch on the checking executor."""
  callbacks.install()  # numpy in, our typed errors out
  axis_context = ctx.module_context.axis_context
  axes = paths.manual_axes(axis_context)
  sizes = paths.mesh_sizes(axis_context)
  plan = plan_of(
    dict(params, num_inputs=len(in_nodes)),
    [(a, sizes[a]) for a in axes],
  )
  from mpmd import checking  # (mpmd.checking imports this package)

  asked = path.params  # CheckParams, or an explore / replay session
  if isinstance(asked, checking.CheckParams):
    plan.identical_writes_race = asked.identical_writes_race
  launch = Launch(plan, path.params.owner())
  out_avals = plan.out_avals

  def body(*args):
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    if not axes:
      return io_callback(launch, shapes, *args, ordered=False)
    args = [jax.lax.all_gather(a, axes) for a in args]
    index = np.int32(0)
    for a in axes:
      index = index * np.int32(sizes[a]) + jax.lax.axis_index(a)
    return io_callback(launch, shapes, *args, index, ordered=False)

  with _jax.no_vma_check():
    return mlir.lower_fun(body, multiple_results=True)(
      ctx.replace(avals_in=common.plain_avals(ctx.avals_in)), *in_nodes
    )
