"""Finding ``mpmd_map`` launches in a traced function (imported by module
name from any test: tests/ is on pytest's pythonpath)."""

import jax
import jax.extend

import mpmd
from mpmd.lowering import paths


def launch_eqns(f, *args) -> list[jax.extend.core.JaxprEqn]:
  """The ``mpmd_map_p`` equations of ``f``'s jaxpr, nested ones included,
  in order."""
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is mpmd.mpmd_map_p:
        found.append(eqn)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(f)(*args).jaxpr)
  return found


def kernel_path(f, *args) -> paths.Path:
  """Which CPU-fallback path the first mpmd_map launch inside ``f`` takes."""
  found = launch_eqns(f, *args)
  assert found, "no mpmd_map launch in the jaxpr"
  return found[0].params["cpu_path"]
