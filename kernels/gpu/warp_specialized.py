"""The warp-specialized pipeline: a memory mesh issues TMA copies into a ring
of SMEM slots, a compute mesh runs the body and releases them; register
budgets of the two."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
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
  i32,
  is_static,
  run_once,
  slot_count,
  unravel,
  when,
)

# Registers per thread (H100): a warpgroup may use at most this many, and a
# warpgroup-sized share of the 64K register file is 512. ``setmaxnreg`` takes
# multiples of the granule between the minimum and the maximum.
_MIN_REGISTERS = 24


_MAX_REGISTERS = 256


_REGISTER_FILE_PER_WG = 512


_REGISTER_GRANULE = 8


MEMORY_WG_REGISTERS = 40


def compute_registers(num_compute_wgs: int, memory_registers: int) -> int:
  """Registers per thread for each compute warpgroup.

  The register file holds ``_REGISTER_FILE_PER_WG`` registers per thread of
  one warpgroup; the memory warpgroup keeps ``memory_registers`` and the
  compute warpgroups split the rest, capped at the per-thread maximum and
  rounded down to the allocation granule.
  """
  share = (_REGISTER_FILE_PER_WG - memory_registers) // num_compute_wgs
  share = min(_MAX_REGISTERS, share)
  return share // _REGISTER_GRANULE * _REGISTER_GRANULE


def _check_registers(where: str, memory_registers: Any) -> None:
  if memory_registers is None:
    return
  if isinstance(memory_registers, bool) or not isinstance(
    memory_registers, int
  ):
    raise TypeError(
      f"{where}: expected 'memory_registers' an int or None, got "
      f"{memory_registers!r}"
    )
  if (
    not _MIN_REGISTERS <= memory_registers <= _MAX_REGISTERS
    or memory_registers % _REGISTER_GRANULE
  ):
    raise ValueError(
      f"{where}: expected 'memory_registers' a multiple of "
      f"{_REGISTER_GRANULE} in [{_MIN_REGISTERS}, {_MAX_REGISTERS}], got "
      f"{memory_registers}"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class WarpSpecializedPipeline:
  """A pipeline split between a memory mesh and a compute mesh.

  Build it with :func:`warp_specialized_pipeline`. Its three parts go into one
  ``mpmd_map`` call (or :func:`warp_specialized_kernel` assembles it):

  * :meth:`scratch_types`: the SMEM rings and barriers, passed in
    ``scratch_types`` so that both meshes share them;
  * :meth:`memory`: called by the memory mesh's function (one warpgroup);
  * :meth:`compute`: called by the compute mesh's function (every compute
    warpgroup).
  """

  body: Callable[..., Any]
  grid: tuple[GridEntry, ...]
  ins: tuple[Operand, ...]
  outs: tuple[Operand, ...]
  slots: int
  delay_release: int
  num_compute_wgs: int
  manual_consumed_barriers: bool
  compute_context: Callable[..., Any] | None
  memory_registers: int | None
  manual_produced_barriers: bool = False

  @property
  def num_steps(self) -> GridEntry:
    return count_steps(self.grid)

  @property
  def _synced(self) -> bool:
    """Whether the meshes meet through barriers at every step."""
    return (
      any(op.streamed for op in self.ins)
      or self.manual_consumed_barriers
      or self.manual_produced_barriers
    )

  def scratch_types(self, *gmem_types: Any) -> dict[str, Any]:
    """SMEM and barrier types for ``mpmd_map(..., scratch_types=...)``.

    Args:
      *gmem_types: the GMEM operands the pipeline will be called with (after
        any slicing), as anything with ``shape`` and ``dtype``.

    Returns:
      A dict pytree of ``plgpu.SMEM`` / ``plgpu.Barrier`` types (None where a
      buffer is not needed): pass it in ``scratch_types`` and hand the refs
      that the kernel function receives to :meth:`memory` and
      :meth:`compute` as ``scratch``.
    """
    where = "warp_specialized_pipeline.scratch_types"
    in_types = gmem_types[: len(self.ins)]
    out_types = gmem_types[len(self.ins) :]
    check_refs(where, self.ins, in_types, "input")
    check_refs(where, self.outs, out_types, "output")
    num_consumed = len(self.ins) if self.manual_consumed_barriers else 1
    return dict(
      **Inputs.scratch_types(
        self.ins, in_types, self.slots, self.manual_produced_barriers
      ),
      **Outputs.scratch_types(self.outs, out_types),
      consumed=[
        plgpu.Barrier(
          num_arrivals=self.num_compute_wgs, num_barriers=self.slots
        )
        for _ in range(num_consumed)
      ]
      if self._synced
      else [],
    )

  def _inputs(self, in_gmem: Sequence[Any], scratch: dict[str, Any]):
    return Inputs(
      self.ins,
      in_gmem,
      scratch,
      self.grid,
      self.slots,
      self.manual_produced_barriers,
    )

  def memory(
    self,
    *gmem_refs: Any,
    scratch: dict[str, Any],
    pipeline_state: Any = None,
  ) -> None:
    """The memory warpgroup's part: every GMEM->SMEM copy.

    Args:
      *gmem_refs: the GMEM input and output refs, as for :func:`pipeline`.
      scratch: the refs of :meth:`scratch_types`.
      pipeline_state: None, or a ``plgpu.PipelinePipeline`` state (or an
        int32 scalar holding one) when this call is one of a sequence of
        pipelines sharing ``scratch``, as for
        :func:`~mpmd.kernels.gpu.upstream.emit_pipeline_warp_specialized`.
    """
    prologue, quiesce = pipeline_state_flags(
      "warp_specialized_pipeline", self, pipeline_state
    )
    if self.memory_registers is not None:
      plgpu.set_max_registers(self.memory_registers, action="decrease")
    in_gmem = gmem_refs[: len(self.ins)]
    check_refs("warp_specialized_pipeline", self.ins, in_gmem, "input")
    inputs = self._inputs(in_gmem, scratch)
    inputs.load_once()
    if not self._synced:
      return
    consumed = scratch["consumed"]
    num_steps, slots = self.num_steps, self.slots
    manual_consumed = self.manual_consumed_barriers

    def fetch(step, wait):
      """Loads ``step`` into its slot, after the slot's last reader if
      ``wait``."""
      indices = unravel(step, self.grid)
      slot = inputs.slot(step)
      if wait and not manual_consumed:
        plgpu.barrier_wait(consumed[0].at[slot])
      for i, op in enumerate(self.ins):
        if wait and manual_consumed:
          plgpu.barrier_wait(consumed[i].at[slot])
        if op.streamed:
          inputs.copy(i, indices, slot)
        elif self.manual_produced_barriers:
          # Nothing to copy, but the body waits on every input's barrier.
          plgpu.barrier_arrive(inputs.barrier(i, slot))

    when(
      prologue,
      lambda: inputs.fill(num_steps, functools.partial(fetch, wait=False)),
    )
    if is_static(num_steps):
      filled = min(slots, num_steps)
    else:
      filled = lax.min(jnp.int32(slots), num_steps)
    if isinstance(prologue, bool):
      first = filled if prologue else 0
    else:
      first = jnp.where(prologue, i32(filled), jnp.int32(0))

    def refill(step, carry):
      fetch(step, True)
      return carry

    # int32 steps (here and below): from Python-int bounds they are int64
    # under jax_enable_x64.
    lax.fori_loop(i32(first), i32(num_steps), refill, None)

    def drain():
      # Observe the last releases so that no barrier is left mid-phase.
      def observe(step, carry):
        slot = lax.rem(step, jnp.int32(slots))
        for barrier in consumed:
          plgpu.barrier_wait(barrier.at[slot])
        return carry

      lax.fori_loop(
        i32(num_steps) - filled,
        i32(num_steps) - self.delay_release,
        observe,
        None,
      )

    when(quiesce, drain)

  def compute(
    self,
    *gmem_refs: Any,
    scratch: dict[str, Any],
    body: Callable[..., Any] | None = None,
    compute_context: Callable[..., Any] | None = None,
  ) -> None:
    """A compute warpgroup's part: wait for blocks, run the body, release.

    Args:
      *gmem_refs: the GMEM input and output refs, as for :func:`pipeline`.
      scratch: the refs of :meth:`scratch_types`.
      body: replaces the pipeline's body for this call, typically a closure
        over this warpgroup's index (the allocations do not depend on it).
      compute_context: replaces the pipeline's compute context likewise.
    """
    if body is not None or compute_context is not None:
      pipe = dataclasses.replace(
        self,
        body=body or self.body,
        compute_context=compute_context or self.compute_context,
      )
      return pipe.compute(*gmem_refs, scratch=scratch)
    if self.memory_registers is not None:
      plgpu.set_max_registers(
        compute_registers(self.num_compute_wgs, self.memory_registers),
        action="increase",
      )
    in_gmem = gmem_refs[: len(self.ins)]
    out_gmem = gmem_refs[len(self.ins) :]
    where = "warp_specialized_pipeline"
    check_refs(where, self.ins, in_gmem, "input")
    check_refs(where, self.outs, out_gmem, "output")
    inputs = self._inputs(in_gmem, scratch)
    inputs.wait_once()
    outputs = Outputs(self.outs, out_gmem, scratch["out_smem"], self.grid)
    has_carry = self.compute_context is not None
    produced, consumed = scratch["loaded"], scratch["consumed"]
    delay = self.delay_release

    def step_fn(step, carry):
      runs, body_carry = carry
      indices = unravel(step, self.grid)
      slot = inputs.slot(step)
      # The slot that step ``step - delay`` read, released after this body.
      released = lax.rem(jnp.maximum(step - delay, 0), jnp.int32(self.slots))
      inputs.wait(slot)
      outputs.before_body()
      blocks = [*inputs.body_refs(slot), *outputs.body_refs(runs)]
      if self.manual_produced_barriers:
        blocks += [barrier.at[slot] for barrier in produced]
      if self.manual_consumed_barriers:
        blocks += [barrier.at[released] for barrier in consumed]
      if has_carry:
        new_carry = self.body(indices, *blocks, body_carry)
      else:
        self.body(indices, *blocks)
        new_carry = None
      if consumed and not self.manual_consumed_barriers:

        def release():
          # The body may have read the slot through registers (the generic
          # proxy) and the next TMA into it writes through the async proxy;
          # only a proxy fence orders the two (the simulator checks it from
          # jax 0.11 on).
          plgpu.commit_smem()
          plgpu.barrier_arrive(consumed[0].at[released])

        when(delay == 0 or step >= delay, release)
      return outputs.after_body(step, indices, runs), new_carry

    def loop(carry=None):
      _, final = lax.fori_loop(
        jnp.int32(0), self.num_steps, step_fn, (outputs.init_runs(), carry)
      )
      return final

    if has_carry:
      run_once(where, self.compute_context, loop)
    else:
      loop()
    outputs.finish()


def pipeline_state_flags(
  where: str, pipe: WarpSpecializedPipeline, state: Any
) -> tuple[bool | jax.Array, bool | jax.Array]:
  """(whether to fill the ring first, whether to drain it at the end)."""
  if state is None:
    return True, True
  if pipe.delay_release:
    raise NotImplementedError(
      f"{where}: pipeline_state (a pipeline of pipelines) with "
      f"delay_release={pipe.delay_release} is not supported"
    )
  if not is_static(pipe.num_steps):
    raise NotImplementedError(
      f"{where}: pipeline_state (a pipeline of pipelines) with a traced "
      "grid is not supported"
    )
  if pipe.num_steps % pipe.slots:
    raise NotImplementedError(
      f"{where}: pipeline_state (a pipeline of pipelines) needs the number "
      f"of steps divisible by max_concurrent_steps={pipe.slots}, got "
      f"{pipe.num_steps} steps"
    )
  if any(op.once for op in pipe.ins):
    raise NotImplementedError(
      f"{where}: pipeline_state (a pipeline of pipelines) with "
      "index-invariant inputs is not supported"
    )
  start, stop = plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STOP
  if isinstance(state, plgpu.PipelinePipeline):
    return state == start, state == stop
  dtype = getattr(state, "dtype", None)
  if (
    isinstance(state, bool)
    or dtype is None
    or np.shape(state) != ()
    or not jnp.issubdtype(dtype, jnp.integer)
  ):
    raise TypeError(
      f"{where}: expected 'pipeline_state' None, a plgpu.PipelinePipeline or "
      f"an integer scalar holding one, got {state!r}"
    )
  return state == int(start), state == int(stop)


def make_pipeline(
  where: str,
  body: Callable[..., Any],
  *,
  grid: Any,
  in_specs: Any,
  out_specs: Any,
  max_concurrent_steps: Any,
  num_compute_wgs: Any,
  manual_consumed_barriers: bool,
  manual_produced_barriers: bool,
  compute_context: Callable[..., Any] | None,
  memory_registers: Any,
) -> WarpSpecializedPipeline:
  grid = check_grid(where, grid)
  max_concurrent_steps = check_int(
    where, "max_concurrent_steps", max_concurrent_steps
  )
  num_compute_wgs = check_int(where, "num_compute_wgs", num_compute_wgs)
  _check_registers(where, memory_registers)
  ins = make_operands(where, in_specs, grid, "in_specs")
  outs = make_operands(where, out_specs, grid, "out_specs")
  delays = {op.delay_release for op in ins if op.streamed}
  if len(delays) > 1:
    raise NotImplementedError(
      f"{where}: expected one delay_release for all streamed inputs, got "
      f"{sorted(delays)}"
    )
  delay_release = delays.pop() if delays else 0
  if delay_release >= max_concurrent_steps:
    raise ValueError(
      f"{where}: expected delay_release < max_concurrent_steps="
      f"{max_concurrent_steps}, got {delay_release}"
    )
  if num_compute_wgs > 1 and any(op.in_smem for op in outs):
    raise NotImplementedError(
      f"{where}: SMEM outputs need num_compute_wgs=1, got "
      f"{num_compute_wgs}; write outputs from compute_context instead"
    )
  return WarpSpecializedPipeline(
    body=body,
    grid=grid,
    ins=ins,
    outs=outs,
    slots=slot_count(max_concurrent_steps, count_steps(grid)),
    delay_release=delay_release,
    num_compute_wgs=num_compute_wgs,
    manual_consumed_barriers=bool(manual_consumed_barriers),
    compute_context=compute_context,
    memory_registers=memory_registers,
    manual_produced_barriers=bool(manual_produced_barriers),
  )


def warp_specialized_pipeline(
  body: Callable[..., Any],
  *,
  grid: Sequence[GridEntry],
  in_specs: Sequence[pl.BlockSpec] = (),
  out_specs: Sequence[pl.BlockSpec] = (),
  max_concurrent_steps: int = 2,
  num_compute_wgs: int = 1,
  manual_consumed_barriers: bool = False,
  manual_produced_barriers: bool = False,
  compute_context: Callable[..., Any] | None = None,
  memory_registers: int | None = MEMORY_WG_REGISTERS,
) -> WarpSpecializedPipeline:
  """Builds a pipeline whose copies and compute run on different meshes.

  The memory mesh (one warpgroup) keeps ``max_concurrent_steps`` steps of
  input blocks in flight in a ring of SMEM slots. Each slot has a "loaded"
  barrier (the TMA copies arrive on it) and a "consumed" barrier (every
  compute warpgroup arrives on it when its body no longer reads the slot).
  The memory warpgroup refills a slot after its consumed barrier completes;
  compute warpgroups wait on the loaded barrier before their body.

  Args:
    body: ``body(indices, *in_blocks, *out_blocks[, *produced][,
      *consumed][, carry])``. ``produced`` (one barrier per input, for this
      step's slot) is passed only with ``manual_produced_barriers``: the body
      then waits on them itself before reading the blocks. ``consumed`` (one
      barrier per input, for the slot of step ``step - delay_release``) is
      passed only with ``manual_consumed_barriers``; the body must then
      arrive on each of them exactly once per step from step
      ``delay_release`` on. ``carry`` is passed (and the next carry
      returned) only with ``compute_context``.
    grid: sequential grid walked in row-major order: ints or traced integer
      scalars, as for :func:`pipeline`.
    in_specs: input block specs, as for :func:`pipeline`. Every streamed
      input must use the same ``delay_release``.
    out_specs: output block specs; SMEM outputs need ``num_compute_wgs=1``
      (the compute warpgroup stores them when their block changes).
    max_concurrent_steps: SMEM slots per streamed input.
    num_compute_wgs: warpgroups in the compute mesh; each runs the body on
      every step (it picks its share of the block with its axis index).
    manual_consumed_barriers: the body releases slots itself (e.g. after an
      asynchronous WGMMA that reads them has finished); a body that read a
      slot through registers calls ``plgpu.commit_smem()`` before releasing
      it, so that the next TMA into the slot is ordered after the reads.
    manual_produced_barriers: the body waits for the loads itself (e.g. one
      input at a time).
    compute_context: ``compute_context(run)`` runs only on compute
      warpgroups; ``run(init_carry)`` runs the pipeline and returns the final
      carry, so the context can set up an accumulator and an epilogue.
    memory_registers: registers per thread left to the memory warpgroup (the
      compute warpgroups take the rest); None leaves registers alone.

  Returns:
    A :class:`WarpSpecializedPipeline`.

  Example::

    pipe = warp_specialized_pipeline(
        body, grid=(k // 64,),
        in_specs=[plgpu.BlockSpec((128, 64), lambda k: (0, k))])
    call = warp_specialized_kernel(
        pipe, out_types=..., scratch_types=pipe.scratch_types(x_type),
        compute_fn=lambda x, o, s, wg: pipe.compute(x, scratch=s),
        memory_fn=lambda x, o, s: pipe.memory(x, scratch=s))
  """
  return make_pipeline(
    "warp_specialized_pipeline",
    body,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    max_concurrent_steps=max_concurrent_steps,
    num_compute_wgs=num_compute_wgs,
    manual_consumed_barriers=manual_consumed_barriers,
    manual_produced_barriers=manual_produced_barriers,
    compute_context=compute_context,
    memory_registers=memory_registers,
  )
