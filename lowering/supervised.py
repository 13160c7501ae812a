"""A simulator launch, lowered: each device's part of it enters the
simulator, runs its device's simulation and leaves (``lowering/watchdog.py``
keeps who holds the simulator and ends launches that hang).

From jax 0.11 on, a device's part is one host callback of the caller's
computation that runs the device's simulation as a computation of its own
(``_DeviceProgram``); on jax 0.10 the simulation stays in the caller's
computation between two callbacks (``_in_computation``). docs/design.md,
"One launch at a time", says why.
"""

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpmd import _jax, simulators
from mpmd._jax import callback, core, mlir
from mpmd._lowering import errors, jaxpr_util, watchdog, xla_cpu


def lower_supervised(
  ctx,
  in_nodes,
  *,
  ranges,
  run,
  reset,
  original_failure,
  races_found,
  detect_races,
  races_are_errors,
  orders,
  simulator_effects,
  describe: watchdog.Describe | None = None,
  semaphore_name: Callable[[int], Any] | None = None,
  abandon: Callable[[Exception, int], None] | None = None,
  release_absent: Callable[[], None] | None = None,
):
  """Lowers a simulator ``run`` between two ordered bookkeeping callbacks.

  Before: waiting for the simulator (``enter``), and naming the launch's
  programs for deadlock messages. After: the race detector's verdict, when
  ``detect_races`` (for ``get_races``, and as a ``RaceError`` when
  ``races_are_errors`` and the race policy is "raise"), and leaving the
  simulator to the next launch. A device thread that fails in between
  leaves through ``failed``; ``describe`` (if given) words its failure in
  the user's terms where it can.
  """
  info = watchdog.LaunchInfo(
    ranges,
    describe,
    simulators.get_deadlock_timeout(),
    simulators.get_race_policy(),
    semaphore_name,
    abandon,
    in_computation=not _jax.SIMULATE_DEVICES_AS_COMPUTATIONS,
    release_absent=release_absent,
  )

  def finish(failure, device=None):
    if failure is None and detect_races:
      failure = _race_verdict(races_found(), races_are_errors, info, orders)
    return watchdog.leave(info, failure, device)

  def launch(*args):
    # As the simulators count them: one device thread per device of the
    # enclosing shard_map.
    axis_sizes = dict(core.get_axis_env().axis_sizes)
    coords = [jax.lax.axis_index(name) for name in axis_sizes]
    sizes = tuple(axis_sizes.values())
    device = _OnDevice(info, sizes, reset, original_failure, finish)
    if info.in_computation:
      return _in_computation(device, run, coords, args)
    program = _DeviceProgram(
      jax.make_jaxpr(run)(*map(_shape_of, args)), tuple(axis_sizes)
    )
    return callback.io_callback(
      functools.partial(_run_on_device, device, program),
      [_shape_of(a) for a in program.closed.out_avals],
      *coords,
      *args,
      ordered=True,
    )

  # The launch's ordered callbacks (ours and the simulator's) run on a token
  # chain of their own, started here. Were they on JAX's runtime token, a
  # failed launch would leave that token failed, and every later launch
  # and ordered callback of the process would re-raise its error.
  ordered = {_jax.ordered_io_effect(), *simulator_effects}
  own = mlir.TokenSet({e: mlir.create_token() for e in ordered})
  inner = ctx.replace(tokens_in=own, tokens_out=None)
  # The simulators evaluate the kernel as ordinary JAX code; inside a
  # shard_map(check_vma=True) its device-index arithmetic would mix varying
  # and invariant values, which kernels (traced without vma) may do. So it
  # is traced without vma, and type-checked (jax_enable_checks) so too:
  # checked with vma, the simulator's axis_index would read as mistyped.
  with _jax.no_vma_check():
    return mlir.lower_fun(launch, multiple_results=True)(inner, *in_nodes)


def _race_verdict(
  found: bool, races_are_errors: bool, info: watchdog.LaunchInfo, orders: str
) -> errors.LaunchError | None:
  """Records the race detector's verdict (``mpmd.get_races``); the error
  to raise, if races are errors under the launch's race policy."""
  simulators.record_races(found)
  if found and races_are_errors and info.race_policy == "raise":
    return errors.RaceError(
      "mpmd_map: the simulator's race detector found programs racing on "
      f"a buffer (accesses not ordered by {orders}); "
      "mpmd.set_race_policy('record') records races for "
      "mpmd.get_races() instead"
    )
  return None


# -- jax 0.10: each device's simulation inside the caller's computation -------
#
# Run as a computation of its own (below), a device's simulation would wait
# for a thread of XLA:CPU's pool on jax 0.10, whose threads the callers'
# device computations hold: 8 devices with 256 KiB buffers hung. So on 0.10
# the simulation stays in the caller's computation, between two callbacks
# (entering and leaving the simulator). Two
# launches that do not depend on each other can interleave on one thread
# there: the second's first callback waits for the simulator that the
# first one holds (``_interleaved`` reports it).


def _in_computation(device: "_OnDevice", run, coords, args):
  def begin(*operands):
    where = tuple(int(c) for c in operands[: len(coords)])
    try:
      watchdog.enter(
        device.info,
        device.sizes,
        device.reset,
        device.original_failure,
        where,
      )
    except watchdog.Abandoned as e:
      index = watchdog.flat_index(where, device.sizes)
      raise watchdog.abandon(e, where, index) from None

  def end(*operands):
    where = tuple(int(c) for c in operands[: len(coords)])
    failure = device.finish(None, where)
    if failure is not None:
      raise failure
    return operands[len(coords) :]

  # The two callbacks take (and the second gives back) the first element of
  # each operand and result: data that XLA cannot fold away orders them
  # after the operands and before anything that reads the results. A
  # launch that takes another's results thus begins after that one left.
  callback.io_callback(begin, None, *coords, *_heads(args), ordered=True)
  results = run(*args)
  heads = _heads(results)
  back = callback.io_callback(
    end, [_shape_of(h) for h in heads], *coords, *heads, ordered=True
  )
  back = iter(back)
  return [r if not r.size else _with_head(r, next(back)) for r in results]


def _heads(xs) -> list:
  """One element of each non-empty ``x``, there once all of ``x`` is."""
  return [xla_cpu.witness(x) for x in xs if x.size]


def _with_head(x, head):
  flat = jax.lax.dynamic_update_slice(x.reshape(-1), head, (0,))
  return flat.reshape(x.shape)


# -- one device's part of a launch, as a computation of its own ---------------


def _shape_of(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


class _DeviceProgram:
  """A launch's simulation for one device: ``run`` as traced in the
  launch's ``shard_map``, compiled (on first use) as a computation of its
  own that takes the device's coordinates as arguments.

  The simulators call back into Python at every simulated operation. Were
  those callbacks part of the caller's computation, XLA:CPU, which runs the
  host callbacks of one execution on one thread, could interleave two
  launches of one ``jax.jit`` that do not depend on each other: the
  second's first callback would take the thread, waiting for the simulator,
  while the first launch still needs it. The caller's computation holds
  one callback per device and launch instead, which runs this one through
  (docs/design.md, "One launch at a time").
  """

  def __init__(self, closed, axis_names: tuple):
    self.closed = closed
    self.axis_names = axis_names
    self._lock = threading.Lock()
    self._compiled = None

  def _evaluate(self, consts, coords, args):
    where = dict(zip(self.axis_names, coords, strict=True))

    def rule(eqn, invals):
      if eqn.primitive is _jax.lax_parallel.axis_index_p:
        return [where[eqn.params["axis_name"]]]
      if eqn.primitive is _jax.callback.io_callback_p and eqn.params["ordered"]:
        # Ordered among themselves by the simulator's token values already;
        # an ordered callback would put this computation on JAX's runtime
        # token, which a failed launch would leave failed for every later
        # ordered callback of the process.
        return eqn.primitive.bind(*invals, **dict(eqn.params, ordered=False))
      return None

    jaxpr = self.closed.jaxpr
    with _jax.no_vma_check():
      return jaxpr_util.eval_with_rule(jaxpr, consts, args, rule)

  def __call__(self, coords, args) -> list:
    operands = (self.closed.consts, list(coords), list(args))
    # Compiled once, before any device runs it: a device that called the
    # jitted function while another's first call still ran would wait for
    # that call, which waits for it in the simulator.
    with self._lock:
      if self._compiled is None:
        traced = jax.jit(self._evaluate).trace(*operands)
        self._compiled = traced.lower().compile()
    return [np.asarray(o) for o in self._compiled(*operands)]


@dataclasses.dataclass(frozen=True, eq=False)
class _OnDevice:
  """What a device's part of a launch needs besides its program."""

  info: watchdog.LaunchInfo
  sizes: tuple[int, ...]  # the enclosing shard_map's axis sizes
  reset: Callable[[], None]
  original_failure: Callable[[], BaseException | None]
  finish: Callable[..., errors.LaunchError | None]


def _run_on_device(device: _OnDevice, program: _DeviceProgram, *operands):
  """One device's part of a launch, in one host callback: waits for the
  simulator, runs the device's simulation to its end, and leaves the
  simulator to the next launch, having failed or not."""
  num_coords = len(program.axis_names)
  coords, args = operands[:num_coords], operands[num_coords:]
  watchdog.enter(
    device.info,
    device.sizes,
    device.reset,
    device.original_failure,
    tuple(int(c) for c in coords),
  )
  try:
    outs = program(coords, args)
  except Exception as e:  # noqa: BLE001 (every failure leaves the launch)
    failure = device.finish(errors.launch_error(e) or watchdog.failed(e))
    assert failure is not None  # given a failure, finish returns one
    raise failure from None
  failure = device.finish(None)
  if failure is not None:
    raise failure
  return outs
