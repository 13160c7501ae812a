"""Helpers shared by the kernel tests (imported by module name: pytest puts
this directory on sys.path)."""

import jax
import jax.extend

import mpmd
from mpmd.lowering import paths


def kernel_path(f, *args) -> paths.Path:
  """Which CPU-fallback path the first mpmd_map launch inside ``f`` takes."""
  jaxpr = jax.make_jaxpr(f)(*args)
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is mpmd.mpmd_map_p:
        found.append(eqn)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  assert found, "no mpmd_map launch in the jaxpr"
  return found[0].params["cpu_path"]
