"""Segments: the runs of pure equations between a program's
synchronisation points, each evaluated as one function.

Integer scalar arithmetic (indices, slots, neighbours) runs in numpy
(``scalars``); anything else runs equation by equation in JAX, then, once
segments of the same text have run ``COMPILE_AFTER`` times, as one jitted
function. A segment that rounds floating-point values more than once is
compiled at once: XLA fuses its operations (contracting ``a * b + c`` into
one fused multiply-add, say), so one by one they may round differently,
and a kernel's numbers would depend on how often its segments had run in
the process.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax
from mpmd._jax import core
from mpmd._lowering import jaxpr_util
from mpmd._lowering.check import host_client, scalars


def read(env: dict, v):
  if isinstance(v, core.Literal):
    # On the host: a literal traced as a jax Array carries the mesh of the
    # shard_map it was traced in, which another launch's segment of the
    # same text (compiled once for both) must not see.
    return host(v.val)
  return env[v]


# A segment that has run this often (in any launch: explore runs the same
# kernel many times) is compiled; below, compiling would cost more than
# running its equations one by one.
COMPILE_AFTER = 16

# Operations whose floating-point results are exact (or moved, not
# computed), wherever XLA fuses them: they do not count as rounding.
_EXACT = frozenset(
  (
    lax.abs_p,
    lax.broadcast_in_dim_p,
    lax.ceil_p,
    lax.clamp_p,
    lax.concatenate_p,
    lax.copy_p,
    lax.dynamic_slice_p,
    lax.dynamic_update_slice_p,
    lax.floor_p,
    lax.gather_p,
    lax.iota_p,
    lax.max_p,
    lax.min_p,
    lax.neg_p,
    lax.pad_p,
    lax.reduce_max_p,
    lax.reduce_min_p,
    lax.reshape_p,
    lax.rev_p,
    lax.round_p,
    lax.select_n_p,
    lax.sign_p,
    lax.slice_p,
    lax.squeeze_p,
    lax.transpose_p,
    lax.convert_element_type_p,
  )
)


def _rounds_twice(eqns) -> bool:
  """Whether two or more of ``eqns`` (nested ones included) compute
  floating-point values that round: compiled together, XLA may fuse them
  and round differently from running them one by one."""
  count = 0
  for top in eqns:
    for eqn in (top, *jaxpr_util.iter_eqns_of(top)):
      if eqn.primitive in _EXACT or jaxpr_util.sub_jaxprs(eqn.params):
        continue
      # jnp's test: numpy's knows neither bfloat16 nor PRNG key types.
      if any(
        jnp.issubdtype(getattr(v.aval, "dtype", np.int32), jnp.inexact)
        for v in eqn.outvars
      ):
        count += 1
        if count > 1:
          return True
  return False


class _Shared:
  """What launches know of one segment's text: how often it ran, and its
  compiled functions once it has them."""

  def __init__(self):
    self.calls = 0
    self.compiled = None
    self.on_host = None


@_jax.util.cache(max_size=4096, trace_context_in_key=False)
def _shared(text: str) -> _Shared:
  # Reached by jax.clear_caches() (JAX's own cache utility).
  return _Shared()


class Segment:
  """A run of pure equations: integer scalar arithmetic in numpy
  (``scalars``); else run one by one, then, once segments of the same text
  have run ``COMPILE_AFTER`` times, as one jitted function.

  Inside the host callbacks of a multi-device program on jax 0.10 the
  process's CPU client has no thread left to run a computation (see
  ``host_client``): there a segment is compiled at once for a
  client of our own. Values of extended dtypes (PRNG keys) have no numpy
  form; their segments always run on the process's client.
  """

  def __init__(self, eqns, invars, outvars):
    self.invars, self.outvars = invars, outvars
    self.text = _text(eqns, invars, outvars)
    self.extended = any(
      _jax.is_extended(v.aval.dtype) for v in (*invars, *outvars)
    )
    self.in_numpy = scalars.plan(eqns, invars, outvars)
    self.compile_now = _rounds_twice(eqns)

    def fn(*values):
      env = dict(zip(invars, values, strict=True))
      for eqn in eqns:
        outs = bind_eqn(eqn, [read(env, v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
          if not isinstance(v, core.DropVar):
            env[v] = x
      return [read(env, v) for v in outvars]

    self.eager = fn

  def fn(self, own_client: bool, *values):
    if self.in_numpy is not None:
      try:
        return self.in_numpy(*values)
      except scalars.Fallback:
        pass
    shared = _shared(self.text)
    if own_client and not self.extended:
      if shared.on_host is None:
        avals = [
          jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.invars
        ]
        shared.on_host = host_client.compile_on_host(self.eager, avals)
      return shared.on_host(*values)
    shared.calls += 1
    if shared.compiled is None and (
      self.compile_now or shared.calls > COMPILE_AFTER
    ):
      shared.compiled = jax.jit(self.eager)
    return [host(x) for x in (shared.compiled or self.eager)(*values)]


def host(x):
  """Values live on the host as numpy arrays (no device, sharding or mesh
  of the trace that made them), extended dtypes (PRNG keys) aside."""
  if isinstance(x, jax.Array) and not _jax.is_extended(x.dtype):
    return np.asarray(x)
  return x


def _text(eqns, invars, outvars) -> str:
  """The segment's structure as text (operations, types, parameters and
  dataflow by position): equal texts compute the same function."""
  number = {v: k for k, v in enumerate(invars)}
  parts: list[Any] = [[str(v.aval) for v in invars]]
  for eqn in eqns:
    ins = [
      ("literal", repr(v.val), str(v.aval))
      if isinstance(v, core.Literal)
      else number[v]
      for v in eqn.invars
    ]
    for v in eqn.outvars:
      number[v] = len(number)
    params = sorted((k, str(p)) for k, p in eqn.params.items())
    outs = [str(v.aval) for v in eqn.outvars]
    parts.append((eqn.primitive.name, ins, outs, params))
  parts.append([number[v] for v in outvars])
  return repr(parts)


def bind_eqn(eqn, invals) -> list:
  """Binds a pure equation on values; its outputs as a list."""
  params = eqn.primitive.get_bind_params(eqn.params)
  outs = eqn.primitive.bind(*invals, **params)
  return outs if eqn.primitive.multiple_results else [outs]
