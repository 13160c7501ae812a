"""``mpmd_map`` over a ``plgpu.WarpMesh``: warp specialization inside a
Mosaic GPU kernel.

Inside a GPU kernel body (``mpmd.kernel`` / ``mpmd_map`` over a
``plgpu.Mesh``, or ``plgpu.kernel``), ``mpmd_map([(plgpu.WarpMesh(...),
fn)])()`` runs ``fn`` on each of the 4 warps of the running warpgroup and
joins them, as upstream's ``mpmd_map`` (and ``pl.core_map``) do: it is not a
launch but a fork inside one. It binds Pallas' own warp map, which the Mosaic
GPU lowering knows; on CPU, jax 0.12's Mosaic GPU simulator runs each warp
as a thread, and on jax 0.10.2 (whose simulator runs no warps) the CPU
fallback runs the warps one after another where they do not synchronise
(:mod:`mpmd._lowering.warps`).
"""

import contextvars
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from mpmd import _jax
from mpmd.types import MeshAndFn

# Set while the body of one of our warp maps is traced: a warp map inside
# it is an error (a warp cannot fork again), found at trace time.
_in_warp_map: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "mpmd_in_warp_map", default=False
)

# Upstream's words for a warp map inside a warp map (its GPU simulator's),
# kept in ours so that code matching them still matches.
NESTED_PHRASE = "Cannot {0} over WarpMesh while already {0}ped"


def nested_message(primitive: str, where: str) -> str:
  return (
    f"mpmd_map: a warp map inside a warp map{where}: "
    f"{NESTED_PHRASE.format(primitive)}. A plgpu.WarpMesh forks the warps "
    "of a warpgroup once; a warp cannot fork again"
  )


def has_warp_mesh(meshes_and_fns: Any) -> bool:
  """Whether ``mpmd_map``'s first argument names a ``plgpu.WarpMesh``."""
  if not isinstance(meshes_and_fns, Sequence) or isinstance(
    meshes_and_fns, (str, bytes)
  ):
    return False
  return any(
    isinstance(pair, (tuple, list))
    and len(pair) == 2
    and _jax.is_warp_mesh(pair[0])
    for pair in meshes_and_fns
  )


def warp_map(
  meshes_and_fns: Sequence[MeshAndFn],
  out_types: Any,
  *,
  scratch_types: Any,
  input_output_aliases: Mapping[int, int] | None,
) -> Callable[..., None]:
  """``mpmd_map``'s function for a ``[(plgpu.WarpMesh, fn)]`` call.

  As upstream: one mesh, no inputs, outputs or scratch (the body closes over
  the kernel's Refs and scalars); the function returns None.
  """
  if len(meshes_and_fns) != 1:
    kinds = [type(pair[0]).__name__ for pair in meshes_and_fns]
    raise NotImplementedError(
      "mpmd_map: a plgpu.WarpMesh forks the warps of one warpgroup and "
      f"shares its launch with no other mesh; got the meshes {kinds}. Map "
      "over the WarpMesh alone, inside the body of a GPU kernel"
    )
  mesh, fn = meshes_and_fns[0]
  if not callable(fn):
    raise TypeError(
      "mpmd_map: expected meshes_and_fns[0][1] to be callable, got "
      f"{type(fn).__name__}"
    )
  for arg, value in (
    ("out_types", out_types),
    ("scratch_types", scratch_types),
    ("input_output_aliases", input_output_aliases),
  ):
    if jax.tree_util.tree_leaves(value):
      raise ValueError(
        f"mpmd_map: a warp map (over plgpu.WarpMesh) takes no {arg!r}: its "
        "body writes the kernel's Refs it closes over; expected an empty "
        f"{arg!r}, got {value!r}"
      )

  def body():
    token = _in_warp_map.set(True)
    try:
      fn()
    finally:
      _in_warp_map.reset(token)

  def run(*args) -> None:
    if args:
      raise ValueError(
        "mpmd_map: a warp map (over plgpu.WarpMesh) takes no inputs: its "
        f"body closes over the kernel's Refs; got {len(args)} argument(s)"
      )
    if _in_warp_map.get():
      raise ValueError(nested_message("mpmd_map", ""))
    _jax.bind_warp_map(mesh, body)

  return run
