"""Drop-ins for upstream's ``plgpu.emit_pipeline`` and
``plgpu.emit_pipeline_warp_specialized``.

Same arguments and defaults as upstream on every supported jax, so an
upstream program moves over by changing the import. Both run our pipelines
(:mod:`mpmd.kernels.gpu.pipeline`): the first is :func:`pipeline`, the second
runs the warp-specialized pipeline on the thread axis of one mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
from jax import lax

from mpmd.kernels._common import check_int
from mpmd.kernels.gpu._steps import GridEntry
from mpmd.kernels.gpu.pipeline import pipeline
from mpmd.kernels.gpu.warp_specialized import (
  WarpSpecializedPipeline,
  make_pipeline,
  pipeline_state_flags,
)


def emit_pipeline(
  body: Callable[..., Any],
  *,
  grid: Sequence[GridEntry],
  in_specs: Sequence[pl.BlockSpec] = (),
  out_specs: Sequence[pl.BlockSpec] = (),
  max_concurrent_steps: int = 1,
  init_carry: Any = None,
) -> Callable[..., Any]:
  """Drop-in for upstream's ``plgpu.emit_pipeline``: :func:`pipeline`.

  The same arguments and defaults as upstream (one step in flight unless
  ``max_concurrent_steps`` says more); see :func:`pipeline` for their
  meaning. Beyond upstream, consecutive steps that share an output block
  share its SMEM buffer (the body may accumulate into it) and the block is
  stored after the last of them.

  Args:
    body: ``body(indices, *in_blocks, *out_blocks[, carry])``.
    grid: ints or traced integer scalars; ``()`` is one step.
    in_specs: input block specs.
    out_specs: output block specs.
    max_concurrent_steps: steps in flight (SMEM slots per streamed input).
    init_carry: optional carry; ``body`` then returns the next one.

  Returns:
    ``run(*in_gmem_refs, *out_gmem_refs)``, returning the final carry (or
    None).

  Example::

    def kernel(x_gmem, o_gmem):  # x, o: (64, 256) f32 in GMEM
      def body(indices, x, o):
        o[...] = x[...] + 1.0
      spec = pl.BlockSpec((64, 64), lambda i: (0, i))
      emit_pipeline(body, grid=(4,), in_specs=[spec], out_specs=[spec],
                    max_concurrent_steps=2)(x_gmem, o_gmem)
  """
  return pipeline(
    body,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    max_concurrent_steps=max_concurrent_steps,
    init_carry=init_carry,
  )


# ---------------------------------------------------------------------------
# Drop-in for upstream's emit_pipeline_warp_specialized (one mesh)
# ---------------------------------------------------------------------------


def _spec_tree(specs: Any) -> tuple[Any, ...]:
  # Upstream's normalisation: a lone spec (or pytree node) is one entry and
  # a top-level list is a tuple, so refs passed as *args match it.
  if not isinstance(specs, (list, tuple)):
    return (specs,)
  return tuple(specs)


@dataclasses.dataclass(frozen=True, eq=False)
class EmittedWarpSpecializedPipeline:
  """The pipeline that :func:`emit_pipeline_warp_specialized` returns.

  Call it as ``pipeline(*in_gmem_refs, *out_gmem_refs)`` from every thread
  of the mesh (refs in the pytree structure of the specs). It allocates its
  SMEM and barriers with ``pl.run_scoped`` collectively over ``wg_axis``,
  unless given ``allocations``: the refs of a scope opened by the caller
  with :meth:`get_allocations` (required with ``pipeline_state``, so that a
  sequence of pipelines shares one ring).
  """

  pipe: WarpSpecializedPipeline
  in_tree: jax.tree_util.PyTreeDef
  out_tree: jax.tree_util.PyTreeDef
  num_in: int  # Top-level entries of in_specs.
  wg_axis: str
  memory_thread_idx: int
  pipeline_state: Any

  def _flatten(self, where: str, gmem_refs: Sequence[Any]) -> list[Any]:
    in_refs, out_refs = gmem_refs[: self.num_in], gmem_refs[self.num_in :]
    flat_in, in_tree = jax.tree.flatten(tuple(in_refs))
    flat_out, out_tree = jax.tree.flatten(tuple(out_refs))
    for kind, got, expected in (
      ("input", in_tree, self.in_tree),
      ("output", out_tree, self.out_tree),
    ):
      if got != expected:
        raise ValueError(
          f"{where}: expected {kind} refs with the pytree structure of the "
          f"{kind} specs, {expected}, got {got}"
        )
    return [*flat_in, *flat_out]

  def get_allocations(self, *gmem_refs: Any) -> dict[str, Any]:
    """The scratch types of the pipeline over these refs.

    Args:
      *gmem_refs: the refs (or anything with ``shape`` and ``dtype``) the
        pipeline will be called with.

    Returns:
      A pytree of SMEM and barrier types: open it with
      ``pl.run_scoped(..., collective_axes=wg_axis)`` and pass the refs as
      ``allocations=``.
    """
    flat = self._flatten("emit_pipeline_warp_specialized", gmem_refs)
    return self.pipe.scratch_types(*flat)

  def __call__(self, *gmem_refs: Any, allocations: Any = None) -> None:
    where = "emit_pipeline_warp_specialized"
    flat = self._flatten(where, gmem_refs)
    if allocations is not None:
      self._run(flat, allocations)
      return
    if self.pipeline_state is not None:
      raise ValueError(
        f"{where}: expected 'allocations' (a scope opened with "
        "get_allocations) with a pipeline_state, got None"
      )
    pl.run_scoped(
      lambda scratch: self._run(flat, scratch),
      self.pipe.scratch_types(*flat),
      collective_axes=self.wg_axis,
    )

  def _run(self, flat_refs: Sequence[Any], scratch: Any) -> None:
    def memory():
      self.pipe.memory(
        *flat_refs, scratch=scratch, pipeline_state=self.pipeline_state
      )

    def compute():
      self.pipe.compute(*flat_refs, scratch=scratch)

    is_memory = lax.axis_index(self.wg_axis) == self.memory_thread_idx
    lax.cond(is_memory, memory, compute)


def emit_pipeline_warp_specialized(
  body: Callable[..., Any],
  *,
  grid: Sequence[GridEntry],
  memory_registers: int | None,
  in_specs: Any = (),
  out_specs: Any = (),
  max_concurrent_steps: int = 2,
  wg_axis: str,
  num_compute_wgs: int,
  pipeline_state: Any = None,
  manual_produced_barriers: bool = False,
  manual_consumed_barriers: bool = False,
  compute_context: Callable[..., Any] | None = None,
  memory_thread_idx: int | None = None,
  manual_ready_barriers: bool = False,
) -> EmittedWarpSpecializedPipeline:
  """Drop-in for upstream's ``plgpu.emit_pipeline_warp_specialized``.

  Runs :class:`WarpSpecializedPipeline` inside one mesh whose thread axis
  ``wg_axis`` has ``num_compute_wgs + 1`` warpgroups: thread
  ``memory_thread_idx`` plays the memory mesh (issues the TMA copies), the
  others the compute mesh (run ``body``). Same arguments and semantics as
  upstream (jax 0.10.2 through 0.12, ``manual_produced_barriers``
  included), and beyond upstream: index-invariant inputs (loaded once), a
  memory thread other than the last, and consecutive steps sharing an output
  block share its SMEM buffer (stored after the last of them).

  Args:
    body: ``body(indices, *in_blocks, *out_blocks[, *produced][, *consumed]
      [, carry])``: blocks (and barriers) in the pytree structure of the
      specs, one top-level argument per top-level spec entry; see
      :func:`warp_specialized_pipeline` for the barriers and the carry.
    grid: ints or traced integer scalars; ``()`` is one step.
    memory_registers: registers per thread for the memory thread (40 suits
      an H100); the compute threads split the rest. None leaves registers
      alone.
    in_specs: a pytree of block specs, one leaf per input (a lone spec is a
      one-entry sequence).
    out_specs: likewise for outputs; SMEM outputs need
      ``num_compute_wgs=1``.
    max_concurrent_steps: SMEM slots per streamed input.
    wg_axis: the mesh's thread axis name.
    num_compute_wgs: compute threads on ``wg_axis``.
    pipeline_state: None, or ``plgpu.PipelinePipeline.START`` / ``STEADY``
      / ``STOP`` (or an int32 scalar holding one) for a sequence of
      pipelines that share ``allocations`` without draining in between:
      ``START`` first, then any ``STEADY``, then one ``STOP``. Needs a static
      number of steps divisible by ``max_concurrent_steps``, no
      ``delay_release`` and no index-invariant inputs.
    manual_produced_barriers: pass the "loaded" barriers to the body, which
      waits on them itself.
    manual_consumed_barriers: pass the "consumed" barriers to the body, which
      arrives on them itself (after ``plgpu.commit_smem()`` if it read the
      slot through registers).
    compute_context: ``compute_context(run)`` on the compute threads;
      ``run(init_carry)`` runs the pipeline and returns the final carry.
    memory_thread_idx: the memory thread's index on ``wg_axis`` (default:
      the last, ``num_compute_wgs``).
    manual_ready_barriers: ``manual_produced_barriers``' name in jax 0.11
      and upstream's main; either turns the feature on.

  Returns:
    An :class:`EmittedWarpSpecializedPipeline`: call it with the GMEM refs.

  Example::

    mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

    def kernel(x_gmem, o_gmem):  # x, o: (64, 256) f32 in GMEM
      def body(indices, x, o):
        o[...] = x[...] + 1.0
      spec = pl.BlockSpec((64, 64), lambda i: (0, i))
      emit_pipeline_warp_specialized(
          body, grid=(4,), in_specs=[spec], out_specs=[spec],
          memory_registers=40, wg_axis="wg", num_compute_wgs=1,
      )(x_gmem, o_gmem)

    mpmd.mpmd_map([(mesh, kernel)], jax.ShapeDtypeStruct((64, 256),
                  jnp.float32))(x)
  """
  where = "emit_pipeline_warp_specialized"
  # jax 0.11 and upstream's main call the produced barriers "ready".
  manual_produced_barriers = manual_produced_barriers or manual_ready_barriers
  if not isinstance(wg_axis, str):
    raise TypeError(
      f"{where}: expected 'wg_axis' a str (the mesh's thread axis), got "
      f"{wg_axis!r}"
    )
  in_specs, out_specs = _spec_tree(in_specs), _spec_tree(out_specs)
  flat_in, in_tree = jax.tree.flatten(in_specs)
  flat_out, out_tree = jax.tree.flatten(out_specs)
  manual = (manual_produced_barriers, manual_consumed_barriers)
  flat_body = _flat_body(body, in_tree, out_tree, manual)
  pipe = make_pipeline(
    where,
    flat_body,
    grid=grid,
    in_specs=flat_in,
    out_specs=flat_out,
    max_concurrent_steps=max_concurrent_steps,
    num_compute_wgs=num_compute_wgs,
    manual_consumed_barriers=manual_consumed_barriers,
    manual_produced_barriers=manual_produced_barriers,
    compute_context=compute_context,
    memory_registers=memory_registers,
  )
  memory_thread_idx = _check_memory_thread(
    where, memory_thread_idx, num_compute_wgs
  )
  # Early errors for an unsupported pipeline_state (checked again per call).
  pipeline_state_flags(where, pipe, pipeline_state)
  return EmittedWarpSpecializedPipeline(
    pipe=pipe,
    in_tree=in_tree,
    out_tree=out_tree,
    num_in=len(in_specs),
    wg_axis=wg_axis,
    memory_thread_idx=memory_thread_idx,
    pipeline_state=pipeline_state,
  )


def _flat_body(body, in_tree, out_tree, manual: tuple[bool, bool]):
  """``body`` taking flat blocks (and barriers, where ``manual`` says the
  produced / consumed ones are passed): what the pipeline calls."""
  num_flat_in, num_flat_out = in_tree.num_leaves, out_tree.num_leaves

  def flat_body(indices, *args):
    """Calls ``body`` with blocks and barriers in the specs' structure."""
    blocks_in = args[:num_flat_in]
    blocks_out = args[num_flat_in : num_flat_in + num_flat_out]
    rest = args[num_flat_in + num_flat_out :]
    barriers = []
    for passed in manual:
      if passed:
        barriers += jax.tree.unflatten(in_tree, rest[:num_flat_in])
        rest = rest[num_flat_in:]
    return body(
      indices,
      *jax.tree.unflatten(in_tree, blocks_in),
      *jax.tree.unflatten(out_tree, blocks_out),
      *barriers,
      *rest,
    )

  return flat_body


def _check_memory_thread(where: str, idx, num_compute_wgs: int) -> int:
  """``memory_thread_idx`` checked; None: the last thread."""
  if idx is None:
    idx = num_compute_wgs
  idx = check_int(where, "memory_thread_idx", idx, minimum=0)
  if idx > num_compute_wgs:
    raise ValueError(
      f"{where}: expected 'memory_thread_idx' an int in [0, "
      f"num_compute_wgs={num_compute_wgs}], got {idx!r}"
    )
  return idx
