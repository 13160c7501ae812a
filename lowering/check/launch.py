"""A launch on the checking executor: its lowering and its host callback.

The CPU lowering emits one host callback for the whole launch, and under a
``shard_map`` two per device (``Launch``): every device deposits its
inputs, an XLA all-gather of their tickets tells each device which
deposits make up its call, and the first device to arrive then runs
*all* devices' programs in one machine; the others find its results (or
its error) waiting. No device waits for another inside a callback, so
nothing there can hang. Each device returns only its own outputs (not all
devices' stacked, which every device would copy).
"""

import contextlib
import dataclasses
import gc
import itertools
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

from mpmd import _jax
from mpmd._jax import mlir
from mpmd._lowering import callbacks, common, errors, merge, paths
from mpmd._lowering.check import machine, memory, sync
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


@dataclasses.dataclass
class _Result:
  """A call's outputs per device (or its error), and how many of this
  process's devices have yet to take them."""

  value: Any
  takers: int


class Launch:
  """The host side of one lowered launch: runs it, once per call.

  Under a ``shard_map`` each device's call comes in two callbacks with an
  XLA all-gather between them: ``deposit`` keeps a copy of the device's
  inputs under a ticket; the all-gather hands every device all the
  tickets of its call (a collective never mixes calls), so by ``finish``
  every input of the call is deposited, and the first device there runs
  the launch for all and leaves the results to the others, keyed by the
  tickets. No device waits for another inside a callback, so nothing
  there can hang, and no device's inputs travel to every other device.
  Where the devices span several processes, the inputs are all-gathered
  too (each process runs the whole launch, for its own devices).
  """

  def __init__(self, plan: machine.Plan, check, process: int = 0):
    self.plan = plan
    self.check = check
    self.process = process  # tickets are (process, count)
    self.lock = threading.Lock()  # held while a call's launch runs
    self.deposit_lock = threading.Lock()
    self.counts = itertools.count()
    # A device's inputs by its ticket, until its call's launch runs.
    self.deposits: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
    # A call's result by its tickets, until this process's devices have
    # taken it.
    self.results: dict[tuple[tuple[int, int], ...], _Result] = {}

  def __call__(self, *inputs):
    """Runs a launch outside ``shard_map`` (one device)."""
    with self.lock:
      return _deliver(self._run(inputs), None)

  def deposit(self, *inputs) -> np.ndarray:
    """Keeps a device's inputs; returns their ticket. (Copied: XLA lends
    a callback its operands only while it runs.)"""
    copies = tuple(memory.copy_of(x) for x in inputs)
    with self.deposit_lock:
      ticket = (self.process, next(self.counts) % 2**31)
      self.deposits[ticket] = copies
    return np.array(ticket, np.int32)

  def finish(self, tickets: np.ndarray, position: np.ndarray, *gathered):
    """The outputs of the device at ``position`` of the call whose devices
    took ``tickets``; its inputs are the deposits, or ``gathered`` (every
    device's, where the call spans processes)."""
    key = tuple((int(p), int(c)) for p, c in tickets.reshape(-1, 2))
    with self.lock:
      entry = self.results.get(key)
      if entry is None:
        with self.deposit_lock:
          deposited = [self.deposits.pop(t, ()) for t in key]
        owned = not gathered  # the deposits: copies of this launch's own
        if owned:
          gathered = [list(x) for x in zip(*deposited, strict=True)]
        here = sum(p == self.process for p, _ in key)
        entry = self.results[key] = _Result(self._run(gathered, owned), here)
      entry.takers -= 1
      if entry.takers == 0:
        del self.results[key]
    return _deliver(entry.value, int(position))

  def _run(self, inputs, owned: bool = False):
    # The collector stays off until the machine is gone: its objects,
    # which hold no reference cycle, are freed by refcounting as
    # ``_launch`` returns, and the collector never walks them.
    with _COLLECTOR.paused():
      return self._launch(inputs, owned)

  def _launch(self, inputs, owned: bool):
    """Runs the launch on ``inputs``: XLA's (lent for the callback), or
    the launch's own copies if ``owned`` (its buffers take them)."""
    run: Run = self.check.begin_launch()
    m, execute = _machine(self.plan, run.strategy(self.plan))
    m.inputs_owned = owned
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

  plan.debug_checks = _jax.pallas_core.debug_checks_enabled()

  asked = path.params  # CheckParams, or an explore / replay session
  if isinstance(asked, checking.CheckParams):
    plan.identical_writes_race = asked.identical_writes_race
    plan.unwritten_outputs = asked.unwritten_outputs
  launch = Launch(plan, path.params.owner(), jax.process_index())
  # Other processes' devices deposit their inputs in their own process.
  gather = jax.process_count() > 1
  out_avals = plan.out_avals

  def body(*args):
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    if not axes:
      return io_callback(launch, shapes, *args, ordered=False)
    ticket_type = jax.ShapeDtypeStruct((2,), np.int32)
    kept = () if gather else args
    ticket = io_callback(launch.deposit, ticket_type, *kept, ordered=False)
    tickets = jax.lax.all_gather(ticket, axes)
    index = np.int32(0)
    for a in axes:
      index = index * np.int32(sizes[a]) + jax.lax.axis_index(a)
    gathered = [jax.lax.all_gather(a, axes) for a in args] if gather else []
    return io_callback(
      launch.finish, shapes, tickets, index, *gathered, ordered=False
    )

  with _jax.no_vma_check():
    return mlir.lower_fun(body, multiple_results=True)(
      ctx.replace(avals_in=common.plain_avals(ctx.avals_in)), *in_nodes
    )
