"""The lowering's caches are JAX's: jax.clear_caches() empties them, and
they hold no jaxpr (and no mesh) alive."""

import gc
import weakref

import jax

from mpmd import _arguments, meshes
from mpmd._lowering import host_programs


def test_the_callback_cache_is_jaxs():
  jaxpr = jax.make_jaxpr(lambda x: x + 1.0)(1.0).jaxpr
  assert host_programs._jaxpr_calls_back(jaxpr) is False
  assert host_programs._jaxpr_calls_back.cache_info().currsize >= 1
  jax.clear_caches()
  assert host_programs._jaxpr_calls_back.cache_info().currsize == 0


def test_the_callback_cache_holds_no_jaxpr_alive():
  jaxpr = jax.make_jaxpr(lambda x: x * 2.0)(1.0).jaxpr
  host_programs._jaxpr_calls_back(jaxpr)
  held = weakref.ref(jaxpr)
  del jaxpr
  gc.collect()
  assert held() is None


def test_the_mesh_table_holds_no_mesh_alive():
  # Equal meshes met in one launch are made one object (jax 0.10 compares
  # multi-core TensorCore meshes elementwise); the table that remembers
  # the first of them does not keep it alive once nothing uses it.
  mesh = meshes.tensorcore_mesh("held_by_nobody_else", num_cores=2)
  assert _arguments._canonical_mesh(mesh) is mesh
  again = meshes.tensorcore_mesh("held_by_nobody_else", num_cores=2)
  assert _arguments._canonical_mesh(again) is mesh
  held = weakref.ref(mesh)
  del mesh, again
  gc.collect()
  assert held() is None
