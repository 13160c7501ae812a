"""Software-pipelined and warp-specialized GPU pipelines for ``mpmd_map``.

A pipeline walks a sequential ``grid`` of steps. At every step the body sees
one block of each input and output in shared memory (SMEM); the pipeline
moves blocks between global memory (GMEM) and SMEM with TMA copies so that the
copies of the next ``max_concurrent_steps - 1`` steps overlap the body.

Two flavours share one contract (block specs, body signature, carry):

* :func:`pipeline` runs inside the function of one GPU mesh. The same
  warpgroup issues the copies and runs the body (software pipelining).
* :func:`warp_specialized_pipeline` splits that work across meshes of one
  ``mpmd_map`` call: a *memory* mesh (one warpgroup) issues the TMA copies into
  a ring of SMEM slots and waits for slots to be released, while a *compute*
  mesh (``num_compute_wgs`` warpgroups) waits for the loads, runs the body and
  releases the slots through "consumed" barriers. That is warp specialization
  written as what it is, MPMD: two functions on two meshes sharing SMEM and
  barriers.

Both pipelines support index-invariant operands (loaded once, stored once),
``delay_release`` on inputs (keep a slot alive for ``delay_release`` more steps,
e.g. for asynchronous WGMMA) and outputs that are stored only when their block
changes (consecutive steps with the same output block reuse one SMEM buffer, so
the body may accumulate into it).

Drop-ins for upstream's ``plgpu.emit_pipeline`` and
``plgpu.emit_pipeline_warp_specialized`` live in
:mod:`mpmd.kernels.gpu.upstream`.

Grids and block specs follow Pallas: a grid entry is a positive int or a
traced int32 scalar (the number of steps is then known only when the kernel
runs); a block dimension is an int or ``pl.Blocked(n)`` (block ``i`` covers
``[i * n, (i + 1) * n)``), ``pl.Element(n)`` (the index map returns the
element offset of a window of ``n``) or ``None`` / ``pl.Squeezed()`` (one
element, dropped from the SMEM block).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from mpmd.kernels.gpu.operands import (
  OUTPUT_SLOTS,
  Outputs,
  check_refs,
  check_steps,
  make_operands,
)
from mpmd.kernels.gpu.steps import (
  GridEntry,
  check_grid,
  count_steps,
  is_static,
  run_once,
  slot_count,
  unravel,
  when,
)


def pipeline(
  body: Callable[..., Any],
  *,
  grid: Sequence[GridEntry],
  in_specs: Sequence[pl.BlockSpec] = (),
  out_specs: Sequence[pl.BlockSpec] = (),
  max_concurrent_steps: int = 2,
  init_carry: Any = None,
  compute_context: Callable[..., Any] | None = None,
  collective_axes: str | tuple[str, ...] = (),
) -> Callable[..., Any]:
  """Builds a software pipeline to call inside one GPU mesh's function.

  At step ``s`` of the row-major walk over ``grid`` the body runs on SMEM
  blocks while TMA copies for steps ``s + 1 .. s + max_concurrent_steps - 1``
  are in flight. Inputs whose ``index_map`` ignores the grid are loaded once;
  outputs are stored when their block index changes (and index-invariant
  outputs once, after the last step).

  Args:
    body: ``body(indices, *in_blocks, *out_blocks[, carry])``; ``indices`` is
      a tuple of int32 scalars, blocks are SMEM refs of the block shape (with
      squeezed dims dropped). With ``init_carry`` it returns the next carry,
      otherwise None.
    grid: sequential grid walked in row-major order (a tuple or list; ``()``
      is one step): positive ints, or integer scalars traced in the kernel
      (e.g. read from a ref or computed from ``lax.axis_index``), which may
      be zero.
    in_specs: one ``pl.BlockSpec`` / ``plgpu.BlockSpec`` per input. Block
      dims: ints or ``pl.Blocked`` (dividing the operand's dim),
      ``pl.Element(n)`` (the index map returns an element offset) or
      ``None`` / ``pl.Squeezed()``; ``block_shape=None`` is the whole
      operand. ``index_map`` maps grid indices to block indices (None: block
      0). ``plgpu.BlockSpec`` may add SMEM ``transforms`` (tiling, swizzle),
      ``delay_release`` (jax 0.12's ``oob_fill_mode`` is accepted and
      ignored: copies keep the default, zero fill). A spec with
      ``memory_space=plgpu.GMEM`` passes the whole GMEM ref to the body.
    out_specs: like ``in_specs``, for outputs.
    max_concurrent_steps: SMEM slots per streamed input (steps in flight);
      capped at the number of steps of a static grid.
    init_carry: optional pytree carried through the body.
    compute_context: instead of ``init_carry``, ``compute_context(run)`` is
      called inside the pipeline's SMEM scope; ``run(init_carry)`` runs the
      steps and returns the final carry. Use it to allocate a WGMMA
      accumulator (``pl.run_scoped(..., plgpu.ACC(...))``) around the steps
      and to run an epilogue after them.
    collective_axes: the mesh's thread axis, if it has one (the simulator and
      Mosaic GPU allocate SMEM per block, collectively over the threads).

  Returns:
    ``run(*in_gmem_refs, *out_gmem_refs)``, returning the final carry (or
    None). Call it from a mesh function with one thread per block.

  Example::

    def kernel(x_gmem, o_gmem):
      def body(indices, x, o):
        o[...] = x[...] + 1.0
      spec = pl.BlockSpec((128, 64), lambda i: (0, i))
      pipeline(body, grid=(4,), in_specs=[spec], out_specs=[spec])(
          x_gmem, o_gmem)
  """
  where = "pipeline"
  grid = check_grid(where, grid)
  max_concurrent_steps = check_steps(where, max_concurrent_steps)
  ins = make_operands(where, in_specs, grid, "in_specs")
  outs = make_operands(where, out_specs, grid, "out_specs")
  for i, op in enumerate(ins):
    if op.delay_release >= max_concurrent_steps:
      raise ValueError(
        f"{where}: in_specs[{i}] expected delay_release < "
        f"max_concurrent_steps={max_concurrent_steps}, got "
        f"{op.delay_release}"
      )
  if init_carry is not None and compute_context is not None:
    raise ValueError(
      f"{where}: expected init_carry or compute_context, got both"
    )
  has_carry = init_carry is not None or compute_context is not None
  num_steps = count_steps(grid)
  slots = slot_count(max_concurrent_steps, num_steps)
  streamed = [op.in_smem and not op.invariant for op in ins]
  once = [op.in_smem and op.invariant for op in ins]

  def run(*gmem_refs):
    in_refs, out_refs = gmem_refs[: len(ins)], gmem_refs[len(ins) :]
    check_refs(where, ins, in_refs, "input")
    check_refs(where, outs, out_refs, "output")
    scratch = dict(
      in_smem=[
        op.smem(slots if s else 1, ref) if op.in_smem else None
        for op, ref, s in zip(ins, in_refs, streamed, strict=True)
      ],
      out_smem=[
        op.smem(1 if op.invariant else OUTPUT_SLOTS, ref)
        if op.in_smem
        else None
        for op, ref in zip(outs, out_refs, strict=True)
      ],
      loaded=plgpu.Barrier(num_arrivals=sum(streamed), num_barriers=slots)
      if any(streamed)
      else None,
      loaded_once=plgpu.Barrier(num_arrivals=sum(once)) if any(once) else None,
    )
    return pl.run_scoped(
      lambda **refs: _run(in_refs, out_refs, **refs),
      **scratch,
      collective_axes=collective_axes,
    )

  def _run(in_gmem, out_gmem, *, in_smem, out_smem, loaded, loaded_once):
    def fetch(step, delay=None):
      """Starts the copies of ``step``'s streamed blocks (one delay level)."""
      indices = unravel(step, grid)
      slot = lax.rem(step, jnp.int32(slots))
      for op, gmem, smem, s in zip(
        ins, in_gmem, in_smem, streamed, strict=True
      ):
        if s and (delay is None or op.delay_release == delay):
          op.copy_in(gmem, indices, smem.at[slot], loaded.at[slot])

    zeros = (jnp.int32(0),) * len(grid)
    for op, gmem, smem, o in zip(ins, in_gmem, in_smem, once, strict=True):
      if o:
        op.copy_in(gmem, zeros, smem.at[0], loaded_once)
    if any(streamed):
      for step in range(slots):
        # A traced grid may have fewer steps than slots.
        when(
          is_static(num_steps) or step < num_steps,
          functools.partial(fetch, jnp.int32(step)),
        )
    if loaded_once is not None:
      plgpu.barrier_wait(loaded_once)

    outputs = Outputs(outs, out_gmem, out_smem, grid)
    delays = sorted(
      {op.delay_release for op, s in zip(ins, streamed, strict=True) if s}
    )

    def step_fn(step, carry):
      runs, body_carry = carry
      indices = unravel(step, grid)
      slot = lax.rem(step, jnp.int32(slots))
      if loaded is not None:
        plgpu.barrier_wait(loaded.at[slot])
      outputs.before_body()
      blocks = []
      for op, gmem, smem, s in zip(
        ins, in_gmem, in_smem, streamed, strict=True
      ):
        if not op.in_smem:
          blocks.append(gmem)
        else:
          blocks.append(smem.at[slot if s else 0])
      blocks += outputs.body_refs(runs)
      if has_carry:
        new_carry = body(indices, *blocks, body_carry)
      else:
        body(indices, *blocks)
        new_carry = None
      runs = outputs.after_body(step, indices, runs)
      # A slot is refilled ``delay`` steps after the body that last read it.
      for delay in delays:
        refill = step - delay + slots

        @pl.when(jnp.logical_and(step >= delay, refill < num_steps))
        def _refill(refill=refill, delay=delay):
          fetch(refill, delay)

      return runs, new_carry

    def loop(carry=None):
      _, final = lax.fori_loop(
        0, num_steps, step_fn, (outputs.init_runs(), carry)
      )
      return final

    if compute_context is not None:
      final_carry = run_once(where, compute_context, loop)
    else:
      final_carry = loop(init_carry)
    outputs.finish()
    return final_carry

  return run
