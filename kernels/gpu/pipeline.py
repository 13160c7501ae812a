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

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from mpmd.kernels._common import check_int
from mpmd.kernels.gpu._operands import (
  Inputs,
  Operand,
  Outputs,
  check_refs,
  make_operands,
)
from mpmd.kernels.gpu._steps import (
  GridEntry,
  check_grid,
  count_steps,
  run_once,
  slot_count,
  unravel,
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
  max_concurrent_steps = check_int(
    where, "max_concurrent_steps", max_concurrent_steps
  )
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
  num_steps = count_steps(grid)
  return SoftwarePipeline(
    body=body,
    grid=grid,
    ins=ins,
    outs=outs,
    num_steps=num_steps,
    slots=slot_count(max_concurrent_steps, num_steps),
    init_carry=init_carry,
    compute_context=compute_context,
    collective_axes=collective_axes,
  )


@dataclasses.dataclass(frozen=True, eq=False)
class SoftwarePipeline:
  """The callable that :func:`pipeline` returns: ``run(*in_gmem_refs,
  *out_gmem_refs)``, returning the final carry (or None)."""

  body: Callable[..., Any]
  grid: tuple[GridEntry, ...]
  ins: tuple[Operand, ...]
  outs: tuple[Operand, ...]
  num_steps: GridEntry
  slots: int
  init_carry: Any
  compute_context: Callable[..., Any] | None
  collective_axes: str | tuple[str, ...]

  @property
  def _has_carry(self) -> bool:
    return self.init_carry is not None or self.compute_context is not None

  def __call__(self, *gmem_refs: Any) -> Any:
    in_refs = gmem_refs[: len(self.ins)]
    out_refs = gmem_refs[len(self.ins) :]
    check_refs("pipeline", self.ins, in_refs, "input")
    check_refs("pipeline", self.outs, out_refs, "output")
    types = Inputs.scratch_types(self.ins, in_refs, self.slots)
    types.update(Outputs.scratch_types(self.outs, out_refs))
    return pl.run_scoped(
      lambda **scratch: self._run(in_refs, out_refs, scratch),
      **types,
      collective_axes=self.collective_axes,
    )

  def _run(self, in_gmem, out_gmem, scratch: dict[str, Any]) -> Any:
    """Loads the first blocks, runs the steps, stores the last blocks."""
    inputs = Inputs(self.ins, in_gmem, scratch, self.grid, self.slots)
    inputs.load_once()
    if inputs.loaded:
      inputs.fill(self.num_steps, inputs.load)
    inputs.wait_once()
    outputs = Outputs(self.outs, out_gmem, scratch["out_smem"], self.grid)
    step = functools.partial(self._step, inputs, outputs)

    def loop(carry=None):
      # int32 steps: from a Python-int bound they are int64 under
      # jax_enable_x64.
      _, final = lax.fori_loop(
        jnp.int32(0), self.num_steps, step, (outputs.init_runs(), carry)
      )
      return final

    if self.compute_context is not None:
      final_carry = run_once("pipeline", self.compute_context, loop)
    else:
      final_carry = loop(self.init_carry)
    outputs.finish()
    return final_carry

  def _step(self, inputs: Inputs, outputs: Outputs, step, carry):
    """One step: wait for its blocks, run the body, store, refill."""
    runs, body_carry = carry
    indices = unravel(step, self.grid)
    slot = inputs.slot(step)
    inputs.wait(slot)
    outputs.before_body()
    blocks = [*inputs.body_refs(slot), *outputs.body_refs(runs)]
    if self._has_carry:
      new_carry = self.body(indices, *blocks, body_carry)
    else:
      self.body(indices, *blocks)
      new_carry = None
    runs = outputs.after_body(step, indices, runs)
    self._refill(inputs, step)
    return runs, new_carry

  def _refill(self, inputs: Inputs, step: jax.Array) -> None:
    """Refills the slots that this step's body no longer reads."""
    delays = sorted({op.delay_release for op in self.ins if op.streamed})
    # A slot is refilled ``delay`` steps after the body that last read it.
    for delay in delays:
      refill = step - delay + self.slots

      @pl.when(jnp.logical_and(step >= delay, refill < self.num_steps))
      def _refill(refill=refill, delay=delay):
        inputs.load(refill, delay)
