"""Walking and rewriting kernel jaxprs, into loops, conds and scopes."""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mpmd import _jax
from mpmd._jax import (
  api_util,
  core,
  lax_parallel,
  lu,
  pallas_primitives,
  pe,
  source_info_util,
  state_types,
)


def _map_jaxprs(value: Any, fn: Callable[[Any], Any]) -> Any:
  if _jax.is_jaxpr(value):
    return fn(value)
  if isinstance(value, tuple) and any(_jax.is_jaxpr(v) for v in value):
    return tuple(_map_jaxprs(v, fn) for v in value)
  return value


def sub_jaxprs(params: dict[str, Any]) -> list[core.Jaxpr]:
  """The jaxprs nested in an equation's params (loop bodies, branches...)."""
  found = []

  def collect(j):
    found.append(_jax.open_jaxpr(j)[0])
    return j

  for value in params.values():
    _map_jaxprs(value, collect)
  return found


def iter_eqns_of(eqn: core.JaxprEqn) -> Iterator[core.JaxprEqn]:
  """The equations nested in ``eqn`` (its loop bodies, branches...)."""
  for sub in sub_jaxprs(eqn.params):
    yield from iter_eqns(sub)


def iter_eqns(jaxpr: core.Jaxpr) -> Iterator[core.JaxprEqn]:
  """Every equation of ``jaxpr``, nested ones included, in program order."""
  for eqn in jaxpr.eqns:
    yield eqn
    yield from iter_eqns_of(eqn)


def line(eqn: core.JaxprEqn) -> str:
  """``file.py:12:4 (fn)``: where the user's code has the operation ("" if
  nowhere: an equation JAX made, like a ``sync_copy``'s DMA)."""
  return source_info_util.summarize(eqn.source_info)


def scoped_names(eqn: core.JaxprEqn) -> list[str]:
  """How messages name a ``pl.run_scoped``'s allocations: by the scope
  function's parameters (``pl.run_scoped's 'sem'``), else by position."""
  body = eqn.params["jaxpr"]
  names = getattr(body.debug_info, "arg_names", None) or ()
  if len(names) != len(body.invars):
    names = ()
  return [
    f"pl.run_scoped's {names[k]!r}"
    if names and names[k]
    else f"pl.run_scoped allocation {k}"
    for k in range(len(body.invars))
  ]


def located(
  jaxpr: core.Jaxpr, outer: str = ""
) -> Iterator[tuple[core.JaxprEqn, str]]:
  """(equation, ``line``) for every equation of ``jaxpr``, nested ones too,
  in program order: an equation without a line of its own has the nearest
  enclosing one's (``outer`` for the top level's)."""
  for eqn in jaxpr.eqns:
    where = line(eqn) or outer
    yield eqn, where
    for sub in sub_jaxprs(eqn.params):
      yield from located(sub, where)


def shaped(aval: core.AbstractValue) -> core.ShapedArray:
  """``aval`` as the array type it is: JAX types an atom's aval as an
  ``AbstractValue``, which has no shape or dtype. Raises TypeError for a
  Ref or a token (a caller that may meet those tests for them first)."""
  if not isinstance(aval, core.ShapedArray):
    raise TypeError(f"mpmd: internal error: expected an array, got {aval}")
  return aval


def ref_type(aval: core.AbstractValue) -> state_types.AbstractRef:
  """``aval`` as the Ref type it is (a kernel operand, a scoped
  allocation); TypeError for any other aval."""
  if not isinstance(aval, state_types.AbstractRef):
    raise TypeError(f"mpmd: internal error: expected a Ref, got {aval}")
  return aval


EqnRule = Callable[[core.JaxprEqn, list[Any]], list[Any] | None]


@dataclasses.dataclass(frozen=True)
class FramedRule:
  """An ``EqnRule`` with a ``frame``: a context manager factory entered
  around the equations of every jaxpr it rewrites (the top level, loop
  bodies, branches, scopes), so that it can keep per-jaxpr state and emit
  operations when a jaxpr's equations end."""

  rule: EqnRule
  frame: Callable[[], contextlib.AbstractContextManager[object]]

  def __call__(self, eqn: core.JaxprEqn, invals: list[Any]) -> list[Any] | None:
    return self.rule(eqn, invals)


def eval_with_rule(jaxpr: core.Jaxpr, consts, args, rule: EqnRule) -> list:
  """``core.eval_jaxpr``, with ``rule(eqn, invals)`` binding each equation
  (or None: bound as it is, its nested jaxprs rewritten with ``rule``)."""
  env: dict[core.Var, Any] = {}

  def read(a):
    return a.val if isinstance(a, core.Literal) else env[a]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  frame = rule.frame if isinstance(rule, FramedRule) else contextlib.nullcontext
  with frame():
    for eqn in jaxpr.eqns:
      invals = [read(a) for a in eqn.invars]
      with (
        source_info_util.user_context(eqn.source_info.traceback),
        eqn.ctx.manager,
      ):
        outs = rule(eqn, invals)
        if outs is None:
          outs = bind_rewritten(eqn, invals, rule)
      for v, x in zip(eqn.outvars, outs, strict=True):
        if not isinstance(v, core.DropVar):
          env[v] = x
  return [read(a) for a in jaxpr.outvars]


def bind_rewritten(eqn, invals, rule: EqnRule, **param_updates) -> list[Any]:
  """Binds ``eqn`` (with ``param_updates``), its nested jaxprs rewritten."""
  scope = eqn.primitive is pallas_primitives.run_scoped_p

  def rewrite_one(j):
    if scope or not _jax.is_closed(j):
      return rewrite_scope(j, rule, invals)
    jaxpr, consts = _jax.open_jaxpr(j)
    return _jax.closed_jaxpr(*_retrace(jaxpr, consts, rule))

  # A warp map's body asks for its warp axis, which only it binds.
  warps = _jax.warp_map_parts(eqn, invals)
  with (
    contextlib.nullcontext()
    if warps is None
    else core.extend_axis_env_nd(warps[0].shape.items())
  ):
    params = {
      k: _map_jaxprs(v, rewrite_one)
      for k, v in {**eqn.params, **param_updates}.items()
    }
  outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
  return outs if eqn.primitive.multiple_results else [outs]


def rewrite_scope(
  j: core.Jaxpr,
  rule: EqnRule,
  operands: Sequence[Any],
  prologue: Callable[[tuple[Any, ...]], None] | None = None,
) -> core.Jaxpr:
  """A nested scope (``run_scoped``'s body) rewritten with ``rule``, after
  ``prologue(scoped refs)`` if given; ``operands`` are its equation's."""
  # The scope's constvars are operands of its equation (run_scoped's
  # closed-over refs): rewrite them as inputs and split them off again.
  n = len(j.constvars)
  new, consts = _retrace(pe.convert_constvars_jaxpr(j), (), rule, prologue, n)
  if consts:
    raise NotImplementedError(
      "mpmd_map: rewriting a nested kernel scope captured constants"
    )
  scope = _jax.scope_jaxpr(new, n, operands)
  return _jax.replace_jaxpr(scope, debug_info=j.debug_info)  # its names


def _retrace(jaxpr: core.Jaxpr, consts, rule: EqnRule, prologue=None, skip=0):
  def body(*args):
    if prologue is not None:
      prologue(args[skip:])
    return eval_with_rule(jaxpr, consts, args, rule)

  fun = lu.wrap_init(body, debug_info=jaxpr.debug_info)
  new, _, new_consts = pe.trace_to_jaxpr_dynamic(
    fun, [v.aval for v in jaxpr.invars]
  )
  return new, new_consts


def rewrite(jaxpr: core.Jaxpr, rule: EqnRule) -> core.Jaxpr:
  """Re-traces ``jaxpr`` (nested jaxprs too), letting ``rule`` replace eqns.

  ``rule(eqn, invals)`` runs where the equation would be bound; it returns
  the equation's outputs, or None to bind the equation as it is. Trace in the
  kernel's mesh context (``mpmd._primitives.mpmd_map.tracing_context``).
  """
  new, consts = _retrace(jaxpr, (), rule)
  if consts:
    raise NotImplementedError("mpmd_map: kernel rewrite captured constants")
  return new


def rewrite_with_inputs(
  jaxpr: core.Jaxpr,
  extra_avals: list[core.AbstractValue],
  make_rule: Callable[[tuple[Any, ...]], EqnRule],
  finish: Callable[[], None] | None = None,
) -> core.Jaxpr:
  """``rewrite`` that appends inputs of ``extra_avals`` to ``jaxpr``.

  ``make_rule(extra)`` builds the rule from the new inputs' tracers, which
  only the top level may use (nested jaxprs are traced on their own);
  ``finish()`` runs before the top-level trace ends (to drop its tracers).
  """
  num = len(jaxpr.invars)

  def body(*args):
    outs = eval_with_rule(jaxpr, (), args[:num], make_rule(args[num:]))
    if finish is not None:
      finish()
    return outs

  avals = [*(v.aval for v in jaxpr.invars), *extra_avals]
  debug_info = api_util.debug_info("mpmd_map rewrite", body, avals, {})
  fun = lu.wrap_init(body, debug_info=debug_info)
  new, _, consts = pe.trace_to_jaxpr_dynamic(fun, avals)
  if consts:
    raise NotImplementedError("mpmd_map: kernel rewrite captured constants")
  return new


def _axis_names(axis_name: Any) -> tuple[core.AxisName, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def axis_index_rule(
  value_of: Callable[[core.AxisName], Any | None],
  sizes: dict[core.AxisName, int],
) -> EqnRule:
  """A ``rewrite`` rule replacing kernel-mesh axis indices.

  Args:
    value_of: ``axis name -> index`` called where the index is asked for (so
      it may emit operations, e.g. on a super-axis index), or None to keep
      that axis (device-mesh axes under ``shard_map``).
    sizes: the kernel mesh's ``{axis name: size}``, in mesh order (also
      gives ``program_id(i)`` / ``num_programs(i)`` their axis).
  """

  def rule(eqn, invals):
    del invals
    if eqn.primitive is lax_parallel.axis_index_p:
      names = _axis_names(eqn.params["axis_name"])
      values = [value_of(n) for n in names]
      known = [v for v in values if v is not None]
      if not known:
        return None
      if len(known) != len(values):
        raise NotImplementedError(
          f"mpmd_map: axis_index over {names} mixes kernel-mesh axes with "
          "device-mesh axes; ask for each separately"
        )
      index = known[0]
      for name, v in zip(names[1:], known[1:], strict=True):
        index = index * sizes[name] + v
      return [index]
    if eqn.primitive is pallas_primitives.program_id_p:
      value = value_of(list(sizes)[eqn.params["axis"]])
      return None if value is None else [value]
    if eqn.primitive is pallas_primitives.num_programs_p:
      return [np.int32(list(sizes.values())[eqn.params["axis"]])]
    return None

  return rule


def rewrite_axis_indices(jaxpr, value_of, sizes) -> core.Jaxpr:
  """``rewrite`` with ``axis_index_rule(value_of, sizes)``."""
  return rewrite(jaxpr, axis_index_rule(value_of, sizes))


def literal_axis_values(
  sizes: dict[core.AxisName, int], program: int
) -> dict[core.AxisName, np.int32]:
  """The axis indices of flat ``program`` in a mesh of ``sizes`` (row-major)."""
  coords = np.unravel_index(program, tuple(sizes.values()))
  return {n: np.int32(c) for n, c in zip(sizes, coords, strict=True)}


def map_avals(
  jaxpr: core.Jaxpr, fn: Callable[[core.AbstractValue], core.AbstractValue]
) -> core.Jaxpr:
  """``jaxpr`` with every variable's aval replaced by ``fn(aval)``, nested
  jaxprs included (structural: nothing is re-traced or re-checked)."""
  env: dict[core.Var, core.Var] = {}

  def var(v: core.Var) -> core.Var:
    if v not in env:
      cls = core.DropVar if isinstance(v, core.DropVar) else core.Var
      env[v] = cls(fn(v.aval))
    return env[v]

  def atom(a: core.Atom) -> core.Atom:
    return a if isinstance(a, core.Literal) else var(a)

  def sub(j):
    if _jax.is_closed(j):
      jaxpr, consts = _jax.open_jaxpr(j)
      return _jax.closed_jaxpr(map_avals(jaxpr, fn), consts)
    return map_avals(j, fn)

  def effect(e):
    if isinstance(getattr(e, "input", None), core.Var):
      return e.replace(input=var(e.input))
    return e

  constvars = [var(v) for v in jaxpr.constvars]
  invars = [var(v) for v in jaxpr.invars]
  eqns = []
  for eqn in jaxpr.eqns:
    eqns.append(
      eqn.replace(
        invars=[atom(a) for a in eqn.invars],
        outvars=[var(v) for v in eqn.outvars],
        params={k: _map_jaxprs(v, sub) for k, v in eqn.params.items()},
        effects={effect(e) for e in eqn.effects},
      )
    )
  return _jax.replace_jaxpr(
    jaxpr,
    constvars=constvars,
    invars=invars,
    outvars=[atom(a) for a in jaxpr.outvars],
    eqns=eqns,
    effects={effect(e) for e in jaxpr.effects},
    debug_info=jaxpr.debug_info,  # the same inputs: names still hold
  )
