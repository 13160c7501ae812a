"""``warp_specialized_kernel``: one ``mpmd_map`` call that puts a memory mesh
and a compute mesh of warpgroups side by side (or both on the thread axis of
one mesh)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from mpmd.kernels import _common
from mpmd.kernels.gpu.warp_specialized import WarpSpecializedPipeline
from mpmd.types import Interpret

COMPUTE_AXIS = "compute"


MEMORY_AXIS = "memory"


# Thread axis of the single-mesh form (compute warpgroups first, memory last).
SINGLE_MESH_AXIS = "wg"


def warp_specialized_kernel(
  pipe: WarpSpecializedPipeline,
  *,
  compute_fn: Callable[..., None],
  memory_fn: Callable[..., None],
  out_types: Any,
  scratch_types: Any,
  grid: Sequence[int] = (),
  grid_names: Sequence[str] = (),
  multi_mesh: bool = True,
  compiler_params: Any = None,
  interpret: Interpret = None,
  name: str | None = None,
) -> Callable[..., Any]:
  """One ``mpmd_map`` call: a compute mesh and a memory mesh.

  ``compute_fn(*in_refs, *out_refs, scratch, wg_index)`` runs on each of the
  ``pipe.num_compute_wgs`` warpgroups of the compute mesh (thread axis
  ``COMPUTE_AXIS``); ``memory_fn(*in_refs, *out_refs, scratch)`` runs on the
  single warpgroup of the memory mesh (thread axis ``MEMORY_AXIS``).
  ``scratch`` is the pytree of ``scratch_types`` (which must include the
  pipeline's own :meth:`WarpSpecializedPipeline.scratch_types`), shared by
  both meshes. Both meshes have the CTA ``grid`` with ``grid_names``.

  With ``multi_mesh=False`` the same functions run as one mesh of
  ``num_compute_wgs + 1`` threads that branches on its thread index (the
  same schedule, to compare the two forms).

  Args:
    pipe: the pipeline from :func:`warp_specialized_pipeline`.
    compute_fn: the compute warpgroups' kernel (calls ``pipe.compute``).
    memory_fn: the memory warpgroup's kernel (calls ``pipe.memory``).
    out_types: pytree of ``jax.ShapeDtypeStruct`` (GMEM outputs).
    scratch_types: pytree of scratch types shared by both meshes.
    grid: CTA grid (ints), named by ``grid_names``.
    multi_mesh: two meshes (True) or one branching mesh (False).
    compiler_params, interpret, name: as for ``mpmd.mpmd_map``.

  Returns:
    The ``mpmd_map`` callable, taking the input arrays.

  Example (the shape of :func:`mpmd.kernels.gpu.matmul`'s warp-specialized
  form)::

    pipe = warp_specialized_pipeline(body, grid=(k_steps,), in_specs=specs)
    kernel = warp_specialized_kernel(
        pipe,
        compute_fn=lambda a, b, o, scratch, wg: pipe.compute(
            a, b, scratch=scratch),
        memory_fn=lambda a, b, o, scratch: pipe.memory(a, b, scratch=scratch),
        out_types=jax.ShapeDtypeStruct((m, n), jnp.float32),
        scratch_types=pipe.scratch_types(a, b),
    )
    out = kernel(a, b)
  """
  import mpmd  # The kernels package is imported by mpmd; resolve late.

  grid, grid_names = tuple(grid), tuple(grid_names)
  if len(grid) != len(grid_names):
    raise ValueError(
      "warp_specialized_kernel: expected one grid_names entry per grid "
      f"dim, got grid={grid} and grid_names={grid_names}"
    )
  meshes = _two_meshes if multi_mesh else _one_mesh
  return mpmd.mpmd_map(
    meshes(pipe.num_compute_wgs, compute_fn, memory_fn, grid, grid_names),
    out_types=out_types,
    scratch_types=(scratch_types,),
    compiler_params=compiler_params,
    interpret=interpret,
    name=name,
  )


def _two_meshes(num_compute, compute_fn, memory_fn, grid, grid_names):
  """(mesh, kernel) pairs: the compute warpgroups' mesh, the memory one's."""
  compute_mesh = plgpu.Mesh(
    grid=grid,
    grid_names=grid_names,
    num_threads=num_compute,
    thread_name=COMPUTE_AXIS,
  )
  memory_mesh = plgpu.Mesh(
    grid=grid, grid_names=grid_names, num_threads=1, thread_name=MEMORY_AXIS
  )

  @_named_like(compute_fn, drop=1)  # (the warpgroup index)
  def compute_kernel(*refs):
    *refs, scratch = refs
    compute_fn(*refs, scratch, lax.axis_index(COMPUTE_AXIS))

  @_named_like(memory_fn)
  def memory_kernel(*refs):
    *refs, scratch = refs
    memory_fn(*refs, scratch)

  return [(compute_mesh, compute_kernel), (memory_mesh, memory_kernel)]


def _one_mesh(num_compute, compute_fn, memory_fn, grid, grid_names):
  """One (mesh, kernel) pair whose kernel branches on the thread index."""
  mesh = plgpu.Mesh(
    grid=grid,
    grid_names=grid_names,
    num_threads=num_compute + 1,
    thread_name=SINGLE_MESH_AXIS,
  )

  @_named_like(memory_fn)
  def kernel(*refs):
    *refs, scratch = refs
    wg = lax.axis_index(SINGLE_MESH_AXIS)
    lax.cond(
      wg < num_compute,
      lambda: compute_fn(*refs, scratch, wg),
      lambda: memory_fn(*refs, scratch),
    )

  return [(mesh, kernel)]


def _named_like(fn: Callable[..., None], drop: int = 0):
  """Names a ``kernel(*refs)`` wrapper's operands after ``fn``'s
  parameters (less its last ``drop``), so that errors name the user's
  Refs; leaves it as it is where ``fn`` takes ``*args`` or no plain
  positional parameters."""
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):  # (no signature: a builtin, say)
    return lambda kernel: kernel
  plain = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
  )
  if not params or any(p.kind not in plain for p in params):
    return lambda kernel: kernel
  return _common.operand_names([p.name for p in params[: len(params) - drop]])
