"""Device ids known when the kernel is traced.

A kernel that names its peers from its own coordinates (``right =
lax.rem(lax.axis_index("x") + 1, n)``) computes, on every device, a value
that depends on nothing but the device: evaluated here for every device
at once, it tells the lockstep path which ring shift a remote operation
makes before anything runs, so that the devices need not exchange their
targets to agree on it (``exchange.Exchanges``). Values read from memory
(a table of neighbours in SMEM) are only known when the kernel runs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from mpmd import _jax
from mpmd._jax import core, lax_parallel, pallas_primitives
from mpmd._lowering import jaxpr_util


class Known:
  """The values of a kernel's scalar integer variables that depend only on
  literals and the device's coordinates along ``axes``, on every device:
  ``value(var)[d]`` on the device of flat index ``d`` (row-major over
  ``axes``). Nested jaxprs are followed where their inputs are known (a
  loop body's invariants, a scope's closed-over values, a jit's operands).
  """

  def __init__(self, jaxpr: core.Jaxpr, axes: tuple[core.AxisName, ...], sizes):
    self.axes = tuple(axes)
    self.sizes = tuple(sizes[a] for a in self.axes)
    self.count = math.prod(self.sizes)
    coords = np.indices(self.sizes).reshape(len(self.axes), -1)
    self._coords = dict(zip(self.axes, coords.astype(np.int32), strict=True))
    self._values: dict[core.Var, np.ndarray] = {}
    with jax.ensure_compile_time_eval():
      self._scan(jaxpr, {})

  def coords(self, axis: core.AxisName) -> np.ndarray:
    """Every device's coordinate along ``axis`` (one of ``axes``)."""
    return self._coords[axis]

  def value(self, a: core.Atom) -> np.ndarray | None:
    """``a``'s value on every device (a Var or Literal), if known."""
    if isinstance(a, core.Literal):
      if np.ndim(a.val) != 0 or not isinstance(a.aval, core.ShapedArray):
        return None
      return np.full(self.count, a.val, np.dtype(a.aval.dtype))
    return self._values.get(a)

  def _scan(self, jaxpr: core.Jaxpr, known: dict[core.Var, np.ndarray]):
    self._values.update(known)
    for eqn in jaxpr.eqns:
      outs = self._evaluate(eqn)
      if outs is None:
        self._enter(eqn)
        continue
      for v, x in zip(eqn.outvars, outs, strict=True):
        if not isinstance(v, core.DropVar):
          self._values[v] = x

  def _known_inputs(self, operands, invars) -> dict[core.Var, np.ndarray]:
    pairs = ((v, self.value(a)) for a, v in zip(operands, invars, strict=True))
    return {v: x for v, x in pairs if x is not None}

  def _enter(self, eqn: core.JaxprEqn) -> None:
    """Follows ``eqn``'s nested jaxprs, with what is known of their inputs."""
    name, params = eqn.primitive.name, eqn.params
    if name == "while":
      ops = eqn.invars
      cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
      body, _ = _jax.open_jaxpr(params["body_jaxpr"])
      # Only the loop's invariants: its carries change from step to step.
      invariants = self._known_inputs(
        ops[cond_n : cond_n + body_n], body.invars[:body_n]
      )
      self._scan(body, invariants)
    elif name == "scan":
      body, _ = _jax.open_jaxpr(params["jaxpr"])
      n, _ = _jax.scan_layout(params)
      self._scan(body, self._known_inputs(eqn.invars[:n], body.invars[:n]))
    elif name == "cond":
      for branch in params["branches"]:
        j, _ = _jax.open_jaxpr(branch)
        self._scan(j, self._known_inputs(eqn.invars[1:], j.invars))
    elif eqn.primitive is pallas_primitives.run_scoped_p:
      j = params["jaxpr"]
      self._scan(j, self._known_inputs(eqn.invars, j.constvars))

  def _evaluate(self, eqn: core.JaxprEqn) -> list[np.ndarray] | None:
    """``eqn``'s outputs on every device, if they are known scalars."""
    if not all(_is_scalar_int(v.aval) for v in eqn.outvars):
      return None
    if eqn.primitive is lax_parallel.axis_index_p:
      names = eqn.params["axis_name"]
      names = names if isinstance(names, tuple) else (names,)
      if not set(names) <= set(self.axes):
        return None
      index = np.zeros(self.count, np.int32)
      for a in names:
        index = index * self.sizes[self.axes.index(a)] + self._coords[a]
      return [index]
    if eqn.effects:
      return None
    values = [self.value(a) for a in eqn.invars]
    inputs = [x for x in values if x is not None]
    if len(inputs) != len(values):
      return None
    if eqn.primitive.name in ("pjit", "jit", "closed_call"):
      param = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
      j, consts = _jax.open_jaxpr(eqn.params[param])
      if j.constvars or consts:
        return None
      self._scan(j, dict(zip(j.invars, inputs, strict=True)))
      values = [self.value(v) for v in j.outvars]
      outs = [x for x in values if x is not None]
      return outs if len(outs) == len(values) else None
    if jaxpr_util.sub_jaxprs(eqn.params):
      return None

    # No nested jaxprs: the equation's params are its bind params.
    def one(*xs):
      out = eqn.primitive.bind(*xs, **eqn.params)
      return out if eqn.primitive.multiple_results else [out]

    try:
      # Evaluated now, on this host, outside the lowering's (manual) mesh.
      with _jax.mesh_lib.use_abstract_mesh(_jax.mesh_lib.empty_abstract_mesh):
        outs = jax.vmap(one)(*map(jnp.asarray, inputs))
    except NotImplementedError:  # no batching rule: known at run time only
      return None
    return [np.asarray(x) for x in outs]


def _is_scalar_int(aval: core.AbstractValue) -> bool:
  return (
    isinstance(aval, core.ShapedArray)
    and aval.shape == ()
    and (jnp.issubdtype(aval.dtype, jnp.integer) or aval.dtype == jnp.bool_)
  )
