"""Finding ``mpmd_map`` launches in a traced function (imported by module
name from any test: tests/ is on pytest's pythonpath)."""

from collections.abc import Iterator

import jax
import jax.extend

import mpmd
from mpmd._lowering import paths


def eqns(jaxpr) -> Iterator[jax.extend.core.JaxprEqn]:
  """Every equation of ``jaxpr``, nested ones included, in order."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from eqns(sub)


def launch_eqns(f, *args) -> list[jax.extend.core.JaxprEqn]:
  """The ``mpmd_map_p`` equations of ``f``'s jaxpr, nested ones included,
  in order."""
  jaxpr = jax.make_jaxpr(f)(*args).jaxpr
  return [e for e in eqns(jaxpr) if e.primitive is mpmd.mpmd_map_p]


def kernel_path(f, *args) -> paths.Path:
  """Which CPU-fallback path the first mpmd_map launch inside ``f`` takes."""
  found = launch_eqns(f, *args)
  assert found, "no mpmd_map launch in the jaxpr"
  return found[0].params["cpu_path"]
