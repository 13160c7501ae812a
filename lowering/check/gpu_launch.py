"""GPU launches on the checking executor: the plan and the scheduling loop.

The loop is ``sync.run``'s, over GPU operations: at each step the options
are the programs (warpgroups) whose next operation can go ahead and the
TMA copies and WGMMAs in flight; the strategy picks one. A warpgroup that
exits with TMA stores or WGMMAs it never awaited is an error there; no
option left while warpgroups wait is a deadlock, reported at once.
"""

import numpy as np

from mpmd._lowering import errors, paths
from mpmd._lowering.check import (
  gpu,
  gpu_machine,
  gpu_rules,
  interp,
  schedule,
  sync,
)
from mpmd._lowering.check import machine as machine_lib


def plan_of(params, device_axes, *, kernel, labels) -> gpu_machine.GpuPlan:
  """The executor's view of a launch on GPU meshes."""
  gpu_rules.install()
  meshes = params["meshes"]
  mesh, jaxpr, layout = gpu_machine.merged(params)
  grid = gpu_machine.grid_of(mesh)
  name = gpu_rules.unsupported(jaxpr)
  if name is not None:
    raise NotImplementedError(
      f"mpmd checker: the Mosaic GPU operation {name} is not supported "
      "by the checking executor; run the launch with interpret=None (the "
      "Mosaic GPU simulator)"
    )
  threads = None
  if mesh.num_threads is not None:
    threads = (mesh.thread_name, int(mesh.num_threads))
  return gpu_machine.GpuPlan(
    jaxpr=jaxpr,
    num_in=params["num_inputs"],
    out_avals=tuple(params["out_avals"]),
    aliases={o: i for i, o in params["input_output_aliases"].items()},
    device_axes=tuple(device_axes),
    super_axis=None if threads is None else threads[0],
    program_names=gpu_machine.program_names(meshes, grid, layout),
    kernel=kernel,
    labels=labels(jaxpr),
    grid=grid,
    threads=threads,
  )


class _Program:
  def __init__(self, device, program, gen, ctx):
    self.device, self.program = device, program
    self.gen, self.ctx = gen, ctx
    self.pending: interp.Sync | None = None
    self.started = False
    self.done = False

  def next_sync(self) -> interp.Sync:
    """The operation a started warpgroup that has not exited waits at."""
    assert self.pending is not None, (self.device, self.program)
    return self.pending


def _programs(m, inputs) -> list[_Program]:
  plan = m.plan
  programs = []
  for d in range(plan.num_devices):
    coords = plan.device_coords(d)
    device_values = {a: (coords[a], s) for a, s in plan.device_axes}
    for g in range(plan.num_programs):
      values = {**device_values, **plan.axis_values(g)}
      gen, ctx = sync.start(m, inputs, d, g, values)
      programs.append(_Program(d, g, gen, ctx))
  return programs


def _enabled(m, p: _Program) -> bool:
  if not p.started:
    return True
  op = p.next_sync().op
  # Anything else is refused when the program goes on (``_advance``).
  return not isinstance(op, gpu.GpuOp) or op.enabled(m, p)


def _advance(m, p: _Program) -> None:
  result = None
  if p.started:
    sync = p.next_sync()
    if not isinstance(sync.op, gpu.GpuOp):
      raise NotImplementedError(
        f"mpmd checker: {type(sync.op).__name__} in a GPU launch (at "
        f"{sync.where})"
      )
    result = sync.op.perform(m, p, sync.where)
  p.started = True
  try:
    p.pending = p.gen.send(result)
  except StopIteration:
    p.done = True
    p.pending = None
    gpu.check_exit(m, p)
    m.events.append(
      machine_lib.Event(m.step, p.device, p.program, "exit", "kernel exit", "")
    )


def run(m: gpu_machine.GpuMachine, inputs) -> list[list[np.ndarray]]:
  """Runs the launch to its end; the outputs per device."""
  m._operand_buffers(inputs)  # noqa: SLF001
  programs = _programs(m, inputs)
  current = None
  while True:
    options = [
      ("p", i) for i, p in enumerate(programs) if not p.done and _enabled(m, p)
    ]
    options += [("d", k) for k in sorted(m.gpu.asyncs)]
    if not options:
      break
    default = schedule.default_choice(options, current)
    pick = m.pick(options, default)
    if pick[0] == "d":
      gpu.land(m, m.gpu.asyncs.pop(pick[1]))
    else:
      _advance(m, programs[pick[1]])
      current = pick[1]
  waiting = [p for p in programs if not p.done]
  if waiting:
    raise errors.DeadlockError(_deadlock_report(m, waiting))
  return m.outputs()


def _deadlock_report(m, waiting) -> str:
  lines = []
  for p in waiting:
    sync = p.next_sync()
    op = sync.op
    what = op.blocked(m, p) if isinstance(op, gpu.GpuOp) else "an operation"
    lines.append(
      f"  {m.name(p.device, p.program)} waits ({what}) at {sync.where}"
    )
  return (
    f"kernel {m.plan.kernel} deadlocks: no warpgroup can go on and no TMA "
    f"copy or WGMMA is in flight ({m.step} steps in):\n" + "\n".join(lines)
  )


def is_gpu_launch(meshes) -> bool:
  return any(paths.is_gpu_mesh(m) for m in meshes)
