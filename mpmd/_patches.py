"""Where jax-mpmd changes what JAX does: every adaptation, in one place.

It sits behind ``mpmd/_jax.py``: it reaches JAX internals through it only.
``import mpmd`` installs none of it. Each adaptation

- is installed on first use of the feature that needs it (the TPU targets on
  entering ``mpmd.tpu_target`` or tracing / lowering a kernel; the rest on
  lowering a launch for a simulator);
- is installed only on the JAX versions that need it;
- acts only inside our own traces and launches, where the caller says so
  (``active``, ``choose``, ``around``): anywhere else the wrapped function
  runs as JAX wrote it;
- is recorded in ``installed()``, so that a test can check that it took
  effect on every supported version.

Where a hook or a parameter does the job, it is used instead (the
simulators' race policy is a parameter: ``_jax.race_params``).
"""

import contextlib
import contextvars
import functools
from collections.abc import Callable, Generator
from typing import Any

import jax
import numpy as np

from mpmd import _jax

# name -> ((owner, attribute, our wrapper), ...)
_INSTALLED: dict[str, tuple[tuple[object, str, object], ...]] = {}


def installed() -> dict[str, bool]:
  """Every adaptation installed so far -> whether JAX still calls ours
  (``False`` means something replaced it after us; a wrapper of ours
  around another one of ours still calls it)."""
  return {
    name: all(_calls(getattr(owner, attr), ours) for owner, attr, ours in sites)
    for name, sites in _INSTALLED.items()
  }


def _calls(fn, ours) -> bool:
  """Whether ``fn`` is ``ours`` or wraps it (``functools.wraps``)."""
  while fn is not None:
    if fn is ours:
      return True
    fn = getattr(fn, "__wrapped__", None)
  return False


def _wrap(name: str, owners, attr: str, make: Callable[[Any], Any]) -> None:
  """Replaces ``owner.attr`` by ``make(original)`` for each owner."""
  sites = []
  for owner in owners:
    ours = make(getattr(owner, attr))
    setattr(owner, attr, ours)
    sites.append((owner, attr, ours))
  _INSTALLED[name] = tuple(sites)


# -- TPU hardware queries off-TPU (docs/design.md, trap 4) -------------------
# Pallas asks ``tpu_info`` for the attached TPU while tracing (emit_pipeline,
# tiling) and lowering. JAX's own hook, an abstract mesh of TPU devices, leaks
# into the avals of kernels traced inside a CPU shard_map; so inside our
# scopes, and only there, the queries answer for the named target. Outside
# them JAX answers as it would (from 0.11, plain JAX asks ``is_tpu_device()``
# too: in ``lax.logistic``'s lowering and ``Layout.for_array``).

_tpu_answer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
  "mpmd_tpu_answer", default=None
)


@contextlib.contextmanager
def tpu_queries_answered(
  answer: Callable[[], tuple[str, int] | None],
) -> Generator[None, None, None]:
  """Inside: Pallas' TPU queries get ``answer()``'s ``(device kind, cores)``
  (``None``: ask the hardware as usual)."""
  _install_tpu_queries()
  token = _tpu_answer.set(answer)
  try:
    yield
  finally:
    _tpu_answer.reset(token)


def _target() -> tuple[str, int] | None:
  answer = _tpu_answer.get()
  return None if answer is None else answer()


@functools.cache
def _install_tpu_queries() -> None:
  info = _jax.tpu().info
  # Where Pallas looks the queries up, by module attribute: 0.11 moved them
  # to ``jax._src.tpu_info`` and left a re-exporting module behind.
  modules = _jax.tpu().info_modules

  def target_part(index):
    """A query answering part ``index`` of the target's ``(device kind,
    cores)`` under ``mpmd.tpu_target``, and as JAX would elsewhere."""

    def wrap(original):
      @functools.wraps(original)
      def query():
        target = _target()
        return original() if target is None else target[index]

      return query

    return wrap

  def tpu_info(original):
    # Pallas caches get_tpu_info by trace context only: ours asks the
    # per-chip query (cached by its arguments) instead.
    @functools.wraps(original)
    def get_tpu_info():
      target = _target()
      if target is None:
        return original()
      kind, cores = target
      chip = info.chip_version_from_device_kind(kind)
      return info.get_tpu_info_for_chip(chip, cores)

    return get_tpu_info

  _wrap("tpu_device_kind", modules, "get_device_kind", target_part(0))
  _wrap("tpu_num_device_cores", modules, "get_num_device_cores", target_part(1))
  _wrap("tpu_info", modules, "get_tpu_info", tpu_info)
  _install_default_core_count()


def _install_default_core_count() -> None:
  """A TensorCore mesh built without ``num_cores`` (``TensorCoreMesh(
  axis_name=...)``; ``pltpu.create_tensorcore_mesh(name)`` on jax 0.10.2)
  counts the cores of the attached device, which a CPU device does not
  have: under ``mpmd.tpu_target`` it gets the target's."""
  from jax.experimental.pallas import tpu as pltpu

  core = _jax.tpu().core

  def cores(original):
    @functools.wraps(original)
    def default_num_cores():
      target = _target()
      return original() if target is None else target[1]

    return default_num_cores

  if hasattr(core, "_get_default_num_cores"):  # jax >= 0.11
    _wrap("tpu_default_num_cores", [core], "_get_default_num_cores", cores)

    def init(original):
      # The dataclass keeps the default factory it was built with.
      @functools.wraps(original)
      def __init__(self, **kwargs):  # keyword-only dataclass
        target = _target()
        if target is not None and "num_cores" not in kwargs:
          kwargs["num_cores"] = target[1]
        original(self, **kwargs)

      return __init__

    _wrap("tpu_tensorcore_mesh_cores", [core.TensorCoreMesh], "__init__", init)
    return

  def create(original):
    @functools.wraps(original)
    def create_tensorcore_mesh(axis_name, devices=None, num_cores=None):
      target = _target()
      if target is not None and devices is None and num_cores is None:
        num_cores = target[1]
      return original(axis_name, devices=devices, num_cores=num_cores)

    return create_tensorcore_mesh

  # Looked up in each module's own namespace (not through a deprecation
  # shim, which a wrapper must not replace).
  owners = [m for m in (core, pltpu) if "create_tensorcore_mesh" in vars(m)]
  _wrap("tpu_create_tensorcore_mesh", owners, "create_tensorcore_mesh", create)


# -- simulator callbacks take numpy (docs/design.md, trap 3) -----------------


@functools.cache
def route_io_callbacks(choose: Callable[[Any], Callable | None]) -> None:
  """Lets ``choose`` run some ``io_callback``s itself.

  ``choose(flat_callback)`` returns ``run(args)`` for a callback of ours (it
  then gets the numpy arguments as XLA hands them over, without JAX's
  ``device_put``), or ``None``: JAX's implementation runs it. Installed once,
  by the first launch for a simulator.
  """

  def make(original):
    @functools.wraps(original)
    def io_callback_impl(*args, callback, **params):
      run = choose(callback)
      if run is None:
        return original(*args, callback=callback, **params)
      return run(args)

    return io_callback_impl

  _wrap("io_callback_impl", (_jax.callback,), "io_callback_impl", make)


def callback_function(flat_callback) -> Callable | None:
  """The Python function an ``io_callback`` equation calls."""
  return getattr(flat_callback, "callback_func", None)


@functools.cache
def let_gpu_simulator_take_numpy() -> None:
  """Lets the Mosaic GPU simulator's callbacks take numpy arguments.

  Our simulator callbacks get numpy arrays, not jax Arrays (docs/design.md,
  trap 3). From 0.11 on, the simulator rebuilds its thread and
  mesh-location dataclasses from callback arguments with ``_to_int``, which
  takes ints, tracers and jax Arrays but refuses numpy. Only numpy
  arguments (which only our callbacks hand it) take the new branch.
  """
  if _jax.JAX_VERSION < (0, 11):
    return

  def make(to_int):
    @functools.wraps(to_int)
    def _to_int(x):
      if isinstance(x, (np.ndarray, np.generic)):
        return x.item()
      return to_int(x)

    return _to_int

  _wrap("gpu_simulator_to_int", (_jax.gpu().simulator_memory,), "_to_int", make)


# -- a launch's error ends with its call ---------------------------------------


@functools.cache
def end_launch_errors_with_their_call(
  ours: Callable[[BaseException], bool],
) -> None:
  """Lets ``jax.effects_barrier`` pass over errors of ours (``ours(error)``).

  The first call of a computation with host callbacks takes JAX's Python
  dispatch, which keeps each device's runtime token: if the call failed,
  ``effects_barrier`` (and interpreter exit) raise its error again, though
  it reached the caller with the call's results; later calls (JAX's C++
  dispatch) keep none. A launch's failure report ends with its call, as a
  later call's does; any other error is raised as JAX would.
  """

  def make(original):
    @functools.wraps(original)
    def block_until_ready(self):
      tokens = self.output_runtime_tokens
      for device, token in list(tokens.items()):
        try:
          token.block_until_ready()
        except Exception as e:  # noqa: BLE001 (ours dropped, others kept)
          if ours(e):
            del tokens[device]
      return original(self)

    return block_until_ready

  _wrap(
    "runtime_token_errors",
    (_jax.dispatch.RuntimeTokenSet,),
    "block_until_ready",
    make,
  )


# -- simulated waits the watchdog can see -------------------------------------


@functools.cache
def watch_tpu_semaphore_waits(around: Callable[..., Any]) -> None:
  """Runs every TPU simulator ``Semaphore.wait`` inside
  ``around(semaphore, value, global_core_id, has_tasks, logging_info)``, a
  context manager, or as JAX wrote it where ``around`` returns ``None``."""

  def make(original):
    @functools.wraps(original)
    def wait(
      self, value, global_core_id, *, has_tasks=False, logging_info=None
    ):
      scope = around(self, value, global_core_id, has_tasks, logging_info)
      with contextlib.nullcontext() if scope is None else scope:
        return original(
          self,
          value,
          global_core_id,
          has_tasks=has_tasks,
          logging_info=logging_info,
        )

    return wait

  memory = _jax.tpu().simulator_memory
  _wrap("tpu_semaphore_wait", (memory.Semaphore,), "wait", make)


@functools.cache
def watch_tpu_simulator_barriers(around: Callable[..., Any]) -> None:
  """Runs the TPU simulator's barriers among the devices of a launch inside
  ``around(which, device_id)``, a context manager, or as JAX wrote them
  where ``around`` returns ``None``. ``which`` is ``"start"`` (each device
  waits for every other to begin a launch without a collective id) or
  ``"end"`` (each waits for every other to finish)."""

  def make(which):
    def wrap(original):
      @functools.wraps(original)
      def barrier(token, device_id):
        scope = around(which, device_id)
        with contextlib.nullcontext() if scope is None else scope:
          return original(token, device_id)

      return barrier

    return wrap

  simulator = _jax.tpu().simulator
  _wrap("tpu_start_barrier", (simulator,), "_barrier", make("start"))
  _wrap("tpu_end_barrier", (simulator,), "_clean_up_shared_memory", make("end"))


@functools.cache
def watch_gpu_barrier_waits(around: Callable[..., Any]) -> None:
  """Runs every Mosaic GPU simulator ``Barrier.wait`` inside
  ``around(barrier, device, program, logging_info)``, a context manager, or
  as JAX wrote it where ``around`` returns ``None``."""

  def make(original):
    @functools.wraps(original)
    def wait(self, *args, **kwargs):
      device, program, info = _jax.gpu_barrier_waiter(args, kwargs)
      scope = around(self, device, program, info)
      with contextlib.nullcontext() if scope is None else scope:
        return original(self, *args, **kwargs)

    return wait

  memory = _jax.gpu().simulator_memory
  _wrap("gpu_barrier_wait", (memory.Barrier,), "wait", make)


# -- the TPU simulator compiles a program once (0.10.2) -----------------------


def _eval_program(jaxpr, consts, *args):
  _jax.core.eval_jaxpr(jaxpr, consts, *args)


@functools.cache
def cache_tpu_simulator_programs(active: Callable[[], bool]) -> None:
  """Lets the TPU simulator compile each program's jaxpr once.

  0.10.2's simulator runs the programs of a multi-core launch through a jit
  of a function it defines anew on every launch, so every call recompiles
  (two compiles a call for two cores); 0.11 made that function top-level.
  We give 0.10.2 the same, for our launches (``active()``).
  """
  if _jax.JAX_VERSION >= (0, 11):
    return
  thread_map = _jax.tpu().simulator_threads
  run = jax.jit(_eval_program, static_argnums=(0,))

  def make(original):
    @functools.wraps(original)
    def _run_jaxpr(jaxpr, consts, *args):
      if not active():
        return original(jaxpr, consts, *args)
      run.trace(jaxpr, consts, *args).lower().compile()(consts, *args)

    return _run_jaxpr

  _wrap("tpu_simulator_run_jaxpr", (thread_map,), "_run_jaxpr", make)


# -- where a simulated program runs -------------------------------------------


@functools.cache
def route_simulator_programs(run: Callable[..., None]) -> None:
  """Lets ``run(compiled, jaxpr, consts, args)`` run each simulated program.

  Both simulators run every program of a launch (``thread_map``: one thread
  per TPU core or GPU warpgroup) as one XLA computation, ``compiled()``,
  which blocks while its program waits; XLA:CPU runs at most 32 at once
  per device. ``run`` decides where each program runs (calling
  ``compiled()`` runs it as JAX would).
  """
  thread_map = _jax.tpu().simulator_threads

  def make(original):
    @functools.wraps(original)
    def _run_jaxpr(jaxpr, consts, *args):
      run(lambda: original(jaxpr, consts, *args), jaxpr, consts, args)

    return _run_jaxpr

  _wrap("simulator_programs", (thread_map,), "_run_jaxpr", make)
