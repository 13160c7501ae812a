"""DMA windows past their buffers fail on CPU, as they do on hardware.

The fast and lockstep paths copy with ``lax.dynamic_slice`` and
``dynamic_update_slice``, which clamp a window into its buffer: rows
[12, 20) of a 16-row buffer would quietly be rows [8, 16). Mosaic and the
simulators fault instead, and so does the CPU fallback:

* a window fixed in the kernel (literal indices) fails when the kernel is
  traced, with a ``StaticOutOfBoundsError`` (``check_static``, called by
  ``mpmd_map``'s checks for TPU meshes: every CPU path, and lowerings for
  TPU; an ``OutOfBoundsError`` that is also a ``ValueError``);
* any other window is checked where its DMA starts (``Checks``), unless an
  interval analysis proves it in bounds (``prove``: loop counters, program
  indices). The check is a staged ``check_p``: the launch threads which
  check failed first through its control flow (``checked``,
  ``failures.checked``) and, only if one did, one callback raises an
  ``OutOfBoundsError`` after the launch ran.

The same channel reports waits on ``pl.run_scoped`` semaphores that would
block forever (a ``DeadlockError``): those semaphores are gone before the
end-of-launch check of the kernel's own semaphores.
"""

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from mpmd import _jax, _pallas_ops
from mpmd._jax import core, state_types, tree_util
from mpmd._lowering import (
  debug_checks,
  errors,
  failures,
  jaxpr_util,
  watchdog,
)
from mpmd._lowering.debug_checks import escape as _escape
from mpmd._lowering.ranges import (
  CALLS,
  Proven,
  access_side,
  dma_sides,
  parts,
  ref_indexers,
  semaphore_side,
)
from mpmd._pallas_ops import Sync

# Checks whose message starts so report a DeadlockError (DEADLOCK), a
# LeftoverError (LEFTOVER) or a DebugCheckError (debug_checks.DEBUG_CHECK),
# the others an OutOfBoundsError.
DEADLOCK = "mpmd_map deadlock"
LEFTOVER = "mpmd_map leftover"


def operand_names(
  kernel: core.Jaxpr,
  num_in: int,
  num_out: int,
  aliases: Mapping[int, int] | None = None,
) -> list[str]:
  """``'x_hbm' (input 0, f32[16,128])`` for each operand of a traced kernel.

  ``num_in`` counts the values ``mpmd_map`` hoisted out of the kernel (its
  closed-over scalars and Refs): they follow the inputs and have no name.
  ``aliases`` (input -> output) names the output that carries a Ref input
  of the launch (discharged: it bears the Ref's name) as that input.
  """
  arg_names = kernel.debug_info.arg_names or ()
  num_hoisted = sum(1 for n in arg_names if not n)
  named = iter(n for n in arg_names if n)
  num_user_in = num_in - num_hoisted
  carried = {o: i for i, o in (aliases or {}).items()}
  names, given = [], []
  for k, v in enumerate(kernel.invars):
    if k < num_user_in:
      role = f"input {k}"
    elif k < num_in:
      names.append(f"(a closed-over value, {_short(v.aval)})")
      given.append(None)
      continue
    elif k < num_in + num_out:
      role = f"output {k - num_in}"
    else:
      role = f"scratch {k - num_in - num_out}"
    name = next(named, None)
    source = carried.get(k - num_in)
    # A Python function's parameters have distinct names: an output named
    # as the input it is aliased to is that input's Ref, discharged.
    if source is not None and name and given[source] == name:
      role = f"input {source}"
    given.append(name)
    shown = f"{name!r} " if name else ""
    names.append(f"{shown}({role}, {_short(v.aval)})")
  return names


def _short(aval: core.AbstractValue) -> str:
  inner = getattr(aval, "inner_aval", aval)
  return inner.str_short(short_dtypes=True)


class Refs(NamedTuple):
  """What a kernel's nested jaxprs' variables stand for (``trace_refs``)."""

  names: dict[core.Var, str]  # Refs, by the operand they are
  scoped: set[core.Var]  # Refs that pl.run_scoped allocates
  # Literal operands, passed down (or _VARIES between calls)
  literals: dict[core.Var, Any]


def trace_refs(jaxpr: core.Jaxpr, top: Sequence[str]) -> Refs:
  """Follows ``jaxpr``'s operands (named ``top``) into its nested jaxprs."""
  refs = Refs(dict(zip(jaxpr.invars, top, strict=True)), set(), {})
  _trace_nested(jaxpr, refs, {})
  return refs


# A variable of a jaxpr called with different operands (a shared helper).
_VARIES = object()


def _trace_nested(jaxpr: core.Jaxpr, refs: Refs, bound: dict) -> None:
  for eqn in jaxpr.eqns:
    for sub in jaxpr_util.sub_jaxprs(eqn.params):
      held = _held_operands(eqn, sub)
      if held is None:
        # An unknown layout: only Refs (never loop carries) are matched, as
        # the trailing operands, to name them.
        n = min(len(sub.invars), len(eqn.invars))
        pairs = zip(
          sub.invars[len(sub.invars) - n :],
          eqn.invars[len(eqn.invars) - n :],
          strict=True,
        )
        held = [
          (v, x)
          for v, x in pairs
          if isinstance(v.aval, state_types.AbstractRef)
          and _same_type(v.aval, x.aval)
        ]
      if _pallas_ops.kind(eqn) is Sync.RUN_SCOPED:
        for v, name in zip(
          sub.invars, jaxpr_util.scoped_names(eqn), strict=True
        ):
          refs.names[v] = name
          refs.scoped.add(v)
      for v, x in held:
        # What ``v`` holds: a literal's value, else the operand variable.
        literal = isinstance(x, core.Literal)
        source = ("literal", repr(x.val)) if literal else ("var", x)
        if bound.setdefault(v, source) != source:
          refs.literals[v] = _VARIES
          other = None if literal else refs.names.get(x)
          if other is not None and refs.names.get(v, other) != other:
            refs.names[v] = f"{refs.names[v]} or {other}"
          continue
        if literal:
          refs.literals[v] = x
        elif x in refs.literals:
          refs.literals[v] = refs.literals[x]
        elif x in refs.names:
          refs.names[v] = refs.names[x]
          if x in refs.scoped:
            refs.scoped.add(v)
      _trace_nested(sub, refs, bound)


def _held_operands(eqn: core.JaxprEqn, sub: core.Jaxpr) -> list | None:
  """(variable of ``sub``, the operand of ``eqn`` it holds throughout
  ``sub``) pairs: closed-over values, branch operands, loop constants, call
  arguments (loop carries change); None for an unknown layout."""
  name, params, operands = eqn.primitive.name, eqn.params, eqn.invars
  if _pallas_ops.kind(eqn) is Sync.RUN_SCOPED:
    return list(zip(sub.constvars, operands, strict=True))
  if name == "cond":
    return list(zip(sub.invars, operands[1:], strict=True))
  if name == "scan":
    num_consts, _ = _jax.scan_layout(params)
    return list(
      zip(sub.invars[:num_consts], operands[:num_consts], strict=True)
    )
  if name == "while":
    num_cond, num_body = params["cond_nconsts"], params["body_nconsts"]
    if sub is _jax.open_jaxpr(params["cond_jaxpr"])[0]:
      return list(zip(sub.invars[:num_cond], operands[:num_cond], strict=True))
    body_consts = operands[num_cond : num_cond + num_body]
    return list(zip(sub.invars[:num_body], body_consts, strict=True))
  if name in CALLS and len(sub.invars) == len(operands):
    return list(zip(sub.invars, operands, strict=True))
  return None


def _same_type(a: Any, b: Any) -> bool:
  return (
    type(a) is type(b)
    and getattr(a, "shape", None) == getattr(b, "shape", None)
    and getattr(a, "dtype", None) == getattr(b, "dtype", None)
  )


def _static(x: Any, refs: Refs) -> int | None:
  """The value of a static index: a literal (or a variable a literal was
  passed as), a Python or numpy integer; None if traced."""
  if isinstance(x, core.Var):
    x = refs.literals.get(x, x)
    if x is _VARIES:
      return None
  if isinstance(x, core.Literal):
    x = x.val
  if isinstance(x, (core.Var, core.Tracer)):
    return None
  value = np.asarray(x)
  if value.ndim or not np.issubdtype(value.dtype, np.integer):
    return None
  return int(value)


class _Dim(NamedTuple):
  """One index of a window: start and size static (ints) or traced."""

  start: Any
  size: Any
  stride: int
  is_slice: bool
  bound: int  # the size of the dimension it indexes

  @property
  def static(self) -> bool:
    return isinstance(self.start, int) and isinstance(self.size, int)

  def in_bounds(self):
    """A bool, traced unless static."""
    last = self.start + (self.size - 1) * self.stride
    if self.static:
      return self.size <= 0 or (0 <= self.start and last < self.bound)
    return jnp.logical_or(
      self.size <= 0, jnp.logical_and(self.start >= 0, last < self.bound)
    )

  def text(self) -> str:
    """``12:20`` for a static slice, ``12`` for an index."""
    if not self.static:
      return "?"
    if not self.is_slice:
      return str(self.start)
    end = self.start + (self.size - 1) * self.stride + 1
    stride = "" if self.stride == 1 else f":{self.stride}"
    return f"{self.start}:{end}{stride}"


def _windows(static_ref: Any, ref: Any, refs: Refs):
  """A DMA side's root and its windows, outermost first, each a (shape,
  dims) pair; dims static where ``static_ref`` (the equation's operand) is,
  else from ``ref`` (traced; None: left traced)."""
  root, static_levels = ref_indexers(static_ref)
  levels = static_levels if ref is None else ref_indexers(ref)[1]
  windows = []
  for static_indexer, indexer in zip(static_levels, levels, strict=True):
    dims = []
    for static_index, index, bound in zip(
      static_indexer.indices, indexer.indices, indexer.shape, strict=True
    ):
      start, size, stride, is_slice = parts(index)
      static_start, static_size, _, _ = parts(static_index)
      static_start = _static(static_start, refs)
      static_size = _static(static_size, refs)
      dims.append(
        _Dim(
          _int32(start) if static_start is None else static_start,
          _int32(size) if static_size is None else static_size,
          stride,
          is_slice,
          bound,
        )
      )
    windows.append((str(tuple(indexer.shape)), dims))
  return root, windows


def _int32(x: Any) -> Any:
  # Index arithmetic in int32 whatever the index's integer type (strict
  # promotion); arrays of indices (gathers) stay as they are.
  if np.ndim(x) or isinstance(x, core.Var):
    return x
  return lax.convert_element_type(x, jnp.int32)


def _describe(what: str, name: str, chain: str, shapes: list[str]) -> str:
  text = f"{what} window {chain} is out of bounds of {name}"
  if len(shapes) > 1:
    text += f" (its successive .at[] index shapes {', '.join(shapes)})"
  return text


def check_static(jaxpr: core.Jaxpr, names: Sequence[str], kernel: str):
  """Raises ``StaticOutOfBoundsError`` (an ``mpmd.OutOfBoundsError`` and a
  ``ValueError``) for a DMA whose literal indices leave its buffer, or a
  semaphore operation (a DMA wait, a signal, a wait, a read) whose literal
  index leaves its array of semaphores.

  Args:
    jaxpr: a traced kernel, before any rewrite (its literals are the user's).
    names: ``operand_names(jaxpr, ...)``.
    kernel: ``kern at file.py:12`` (the kernel's ``func_src_info``).
  """
  refs = trace_refs(jaxpr, names)
  for eqn, line in jaxpr_util.located(jaxpr):
    if _pallas_ops.kind(eqn) is Sync.DMA_START:
      sides = [(_DMA + role, ref) for role, ref, _ in dma_sides(eqn, None)]
    elif (side := semaphore_side(eqn, None)) is not None:
      sides = [(f"{_operation(eqn)}'s {side[0]}", side[1])]
    else:
      continue
    for what, static_ref in sides:
      root, windows = _windows(static_ref, None, refs)
      dims = [d for _, ds in windows for d in ds if d.static]
      if all(d.in_bounds() for d in dims):
        continue
      chain = "".join(
        f".at[{', '.join(d.text() for d in ds)}]" for _, ds in windows
      )
      shapes = [shape for shape, _ in windows]
      name = refs.names.get(root, "a Ref")
      raise errors.StaticOutOfBoundsError(
        f"mpmd_map: kernel {kernel}: "
        f"{_describe(what, name, chain, shapes)} (at {line}; "
        "hardware would fault)"
      )


# How messages name the operations whose addresses are checked.
_OPERATION = {
  Sync.DMA_START: "a DMA",
  Sync.DMA_WAIT: "a DMA wait",
  Sync.SIGNAL: "a semaphore_signal",
  Sync.SEMAPHORE_WAIT: "a semaphore_wait",
  Sync.SEMAPHORE_READ: "a semaphore_read",
}
_DMA = "a DMA's "


def _operation(eqn: core.JaxprEqn) -> str:
  kind = _pallas_ops.kind(eqn)
  if kind is None or kind not in _OPERATION:
    return eqn.primitive.name
  return _OPERATION[kind]


class Checks:
  """Run-time checks of one kernel, added while it is rewritten (on the
  fast and lockstep paths) where its DMAs start and its scoped semaphores
  are waited on.

  Args:
    kernel: ``kern at file.py:12``.
    refs: ``trace_refs`` of the jaxpr being rewritten.
    proven: ``prove`` of the jaxpr being rewritten (checks not to add).
    path: how the path runs programs, for deadlock messages.
    where: appends traced values that say where a check runs (the device)
      to its argument and returns the text that formats them.
  """

  def __init__(
    self,
    kernel: str,
    refs: Refs,
    proven: Proven,
    path: str,
    where: Callable[[list[Any]], str],
  ):
    self.kernel, self.refs, self.proven = kernel, refs, proven
    self.path, self.where = path, where
    self.count = 0
    # The user's lines of the equations being rewritten around the current
    # one (a sync_copy's DMA has no line of its own: its scope's).
    self.enclosing: list[str] = []

  @contextlib.contextmanager
  def inside(self, eqn: core.JaxprEqn):
    """While the equations nested in ``eqn`` are rewritten."""
    self.enclosing.append(self._line(eqn))
    try:
      yield
    finally:
      self.enclosing.pop()

  def _line(self, eqn: core.JaxprEqn) -> str:
    outer = self.enclosing[-1] if self.enclosing else ""
    return jaxpr_util.line(eqn) or outer

  def _check(self, ok, message: str, args: list[Any]) -> None:
    self.count += 1
    # debug_check, unlike check, may be staged out: the launch is traced
    # first and only then threaded (``checked``).
    if args:
      values = jnp.stack([lax.convert_element_type(a, jnp.int32) for a in args])
      checkify.debug_check(ok, message, values)
    else:
      checkify.debug_check(ok, message)

  def user_check(self, eqn: core.JaxprEqn, invals: Sequence[Any]) -> None:
    """A kernel's own ``pl.debug_check``, where ``pl.enable_debug_checks``
    is on (Mosaic asserts it there): a failure is a ``DebugCheckError``
    naming the kernel, the program and the line, then the user's
    message."""
    failed, fmt, values, named = _pallas_ops.CheckOperands.of(eqn, invals)
    args: list[Any] = []
    prefix = f"{debug_checks.DEBUG_CHECK} in {self._prefix(args)}"
    # pl.debug_check's message is plain text (Mosaic prints it as is); a
    # checkify.debug_check's formats its values.
    text = (
      debug_checks.shift_fields(fmt, 1) if values or named else _escape(fmt)
    )
    message = f"{prefix} at {_escape(self._line(eqn))}: {text}"
    self.count += 1
    where = jnp.stack(
      [lax.convert_element_type(a, jnp.int32) for a in args] or [jnp.int32(0)]
    )
    ok = jnp.logical_not(failed)
    checkify.debug_check(ok, message, where, *values, **named)

  def _prefix(self, args: list[Any]) -> str:
    return f"kernel {_escape(self.kernel)}{self.where(args)}"

  def dma(
    self, eqn: core.JaxprEqn, invals: Sequence[Any], devices=None
  ) -> None:
    """Checks the windows of a ``dma_start`` that may leave their buffers
    (static ones in bounds cost nothing), and where ``devices`` (the
    lockstep path's ``Devices``) are given, that its target is one of
    them."""
    if eqn in self.proven.checks:
      return
    for role, static_ref, ref in dma_sides(eqn, invals):
      self._window(eqn, _DMA + role, static_ref, ref)
    if devices is not None:
      device_id = _pallas_ops.DmaOperands.of(eqn, invals).device_id
      self._device(eqn, device_id, devices)

  def access(self, eqn: core.JaxprEqn, invals: Sequence[Any]) -> None:
    """Checks the window of a read or write of a Ref in place whose
    indices may leave it (JAX would clamp them; hardware faults or touches
    another buffer)."""
    side = access_side(eqn, invals)
    if side is None or eqn in self.proven.checks:
      return
    role, static_ref, ref = side
    self._window(eqn, f"a {role}'s", static_ref, ref)

  def address(self, eqn: core.JaxprEqn, invals: Sequence[Any], devices=None):
    """Checks the semaphore a wait, a signal or a read indexes, and (with
    ``devices``) the device a signal targets."""
    side = semaphore_side(eqn, invals)
    if side is None or eqn in self.proven.addresses:
      return
    role, static_ref, ref = side
    self._window(eqn, f"{_operation(eqn)}'s {role}", static_ref, ref)
    if devices is not None and _pallas_ops.kind(eqn) is Sync.SIGNAL:
      device_id = _pallas_ops.SignalOperands.of(eqn, invals).device_id
      self._device(eqn, device_id, devices)

  def _window(self, eqn, what: str, static_ref: Any, ref: Any) -> None:
    root, windows = _windows(static_ref, ref, self.refs)
    if all(d.static and d.in_bounds() for _, ds in windows for d in ds):
      return
    args: list[Any] = []
    prefix = self._prefix(args)
    oks, chain = [], ""
    for _, dims in windows:
      texts = []
      for d in dims:
        if d.static:
          texts.append(d.text())
          oks.append(jnp.bool_(d.in_bounds()))
        elif np.ndim(d.start):
          # An array of indices (a gather): each must be in bounds.
          oks.append(jnp.all((d.start >= 0) & (d.start < d.bound)))
          texts.append("<indices>")
        else:
          oks.append(d.in_bounds())
          args.append(d.start)
          text = f"{{0[{len(args) - 1}]}}"
          if d.is_slice:
            args.append(d.start + (d.size - 1) * d.stride + 1)
            text += f":{{0[{len(args) - 1}]}}"
            text += "" if d.stride == 1 else f":{d.stride}"
          texts.append(text)
      chain += f".at[{', '.join(texts)}]"
    name = _escape(self.refs.names.get(root, "a Ref"))
    shapes = [shape for shape, _ in windows]
    message = (
      f"mpmd_map: {prefix}: {_describe(what, name, chain, shapes)} (at "
      f"{_escape(self._line(eqn))})"
    )
    self._check(functools.reduce(jnp.logical_and, oks), message, args)

  def _device(self, eqn: core.JaxprEqn, device_id: Any, devices) -> None:
    """Checks that each coordinate of ``device_id`` is within its axis of
    ``devices`` (fixed ones in range cost nothing): past it,
    a DMA or signal reaches no device (on hardware: a fault, or a wait
    that never ends)."""
    if device_id is None:
      return
    device_id = devices.by_axis(device_id)
    for axis, size in zip(devices.axes, devices.sizes, strict=True):
      index = device_id.get(axis)
      static = None if index is None else _static(index, self.refs)
      if index is None or (static is not None and 0 <= static < size):
        continue  # (a fixed one past its axis fails below, when run)
      args: list[Any] = []
      prefix = self._prefix(args)
      index = _int32(index)
      args.append(index)
      operation = _operation(eqn)
      message = (
        f"mpmd_map: {prefix}: {operation} at {_escape(self._line(eqn))} names "
        f"device_id {_escape(repr(axis))}={{0[{len(args) - 1}]}}, outside "
        f"the mesh (its axis {_escape(repr(axis))} has size {size})"
      )
      self._check((index >= 0) & (index < size), message, args)

  def scope_leftover(self, eqn: core.JaxprEqn, k: int, count: Any) -> None:
    """Reports a ``pl.run_scoped`` semaphore (allocation ``k`` of ``eqn``)
    that ends its scope counting: a DMA or signal nobody waited for (the
    memory is reused after the scope, a DMA into it may still land)."""
    if (eqn, k) in self.proven.settled:
      return
    args: list[Any] = []
    prefix = self._prefix(args)
    flat = jnp.ravel(count)
    args.append(flat[jnp.argmax(flat != 0)])  # (its first element not 0)
    message = (
      f"{LEFTOVER}: on the CPU {self.path}, {prefix}: "
      f"{_escape(jaxpr_util.scoped_names(eqn)[k])} (at "
      f"{_escape(self._line(eqn))}), a semaphore, ends "
      f"its scope at {{0[{len(args) - 1}]}} (in bytes for a DMA semaphore): "
      "a DMA or signal on it that nobody waited for, or a negative signal"
    )
    self._check(jnp.all(count == 0), message, args)

  def wait(self, eqn: core.JaxprEqn, sem: Any, ok: Any) -> None:
    """Reports a wait on a ``pl.run_scoped`` semaphore that found it short
    (``sem``: the semaphore operand of the waiting equation)."""
    root, _ = ref_indexers(sem)
    if root not in self.refs.scoped or eqn in self.proven.checks:
      return
    args: list[Any] = []
    message = (
      f"{DEADLOCK}: on the CPU {self.path}, {self._prefix(args)} waited on "
      f"{_escape(self.refs.names[root])} for more than had been "
      "signalled (a wait before its signal?), so on hardware it would wait "
      "forever"
    )
    self._check(ok, message, args)


def checked(fn: Callable[..., Any], count: int) -> Callable[..., Any]:
  """``fn`` returning ``(error, outputs)``: ``error`` a ``failures.Failure``
  (which check failed first, with its values), or None when no check was
  added (``count == 0``: nothing to thread through the launch)."""
  if not count:
    return lambda *args: (None, fn(*args))
  return failures.checked(fn)


def failed(error: failures.Failure) -> jax.Array:
  """Whether any check of ``error`` (from ``checked``) failed, traced."""
  return error.code != 0


def first_failure(
  treedef: tree_util.PyTreeDef | None, leaves: Sequence[Any]
) -> Exception | None:
  """The error a failed check reports (None if none failed), from the
  flattened ``error`` of ``checked`` as a callback receives it."""
  if treedef is None:
    return None
  failure = tree_util.tree_unflatten(treedef, list(leaves)).message()
  if failure is None:
    return None
  message = debug_checks.formatted(*failure)
  if message.startswith(DEADLOCK):
    return watchdog.DeadlockError(message)
  if message.startswith(LEFTOVER):
    return errors.LeftoverError(message)
  if message.startswith(debug_checks.DEBUG_CHECK):
    return errors.DebugCheckError(message)
  return watchdog.OutOfBoundsError(message)
