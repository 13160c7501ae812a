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
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from mpmd.types import Interpret

# Buffers per streamed output: the body fills one while the TMA engine drains
# the other.
_OUTPUT_SLOTS = 2

# Registers per thread (H100): a warpgroup may use at most this many, and a
# warpgroup-sized share of the 64K register file is 512. ``setmaxnreg`` takes
# multiples of the granule between the minimum and the maximum.
_MIN_REGISTERS = 24
_MAX_REGISTERS = 256
_REGISTER_FILE_PER_WG = 512
_REGISTER_GRANULE = 8
MEMORY_WG_REGISTERS = 40

# A grid entry: a static size or a traced int32 scalar.
GridEntry = int | jax.Array


# ---------------------------------------------------------------------------
# Grids
# ---------------------------------------------------------------------------


def _check_grid(where: str, grid: Any) -> tuple[GridEntry, ...]:
  """Static entries as ints, traced ones as int32 scalars."""
  if isinstance(grid, (int, np.integer)) and not isinstance(grid, bool):
    grid = (grid,)
  if not isinstance(grid, (tuple, list)):
    raise TypeError(
      f"{where}: expected 'grid' as a tuple of ints or int32 scalars, got "
      f"{type(grid).__name__}"
    )
  checked = []
  for g in grid:
    if isinstance(g, bool):
      raise TypeError(
        f"{where}: expected 'grid' entries as ints or int32 scalars, got "
        f"the bool {g}"
      )
    if isinstance(g, (int, np.integer)):
      if g <= 0:
        raise ValueError(
          f"{where}: expected 'grid' of positive ints, got {tuple(grid)}"
        )
      checked.append(int(g))
      continue
    dtype = getattr(g, "dtype", None)
    if (
      dtype is None
      or np.shape(g) != ()
      or not jnp.issubdtype(dtype, jnp.integer)
    ):
      raise TypeError(
        f"{where}: expected 'grid' entries as ints or integer scalars, got "
        f"{g!r}"
      )
    checked.append(lax.convert_element_type(g, jnp.int32))
  return tuple(checked)


def _is_static(value: Any) -> bool:
  return isinstance(value, int)


def _i32(value: GridEntry) -> jax.Array:
  return jnp.int32(value) if _is_static(value) else value


def _num_steps(grid: tuple[GridEntry, ...]) -> GridEntry:
  """The number of steps: an int for a static grid, else an int32 scalar."""
  if all(map(_is_static, grid)):
    return math.prod(grid)
  return functools.reduce(lax.mul, map(_i32, grid))


def _slots(max_concurrent_steps: int, num_steps: GridEntry) -> int:
  # Fewer slots than steps in flight when a static grid is short: SMEM is
  # scarce. A traced grid may be long, so it gets every slot.
  if _is_static(num_steps):
    return min(max_concurrent_steps, num_steps)
  return max_concurrent_steps


def _unravel(step: jax.Array, grid: tuple[GridEntry, ...]):
  """Grid indices (row-major, int32) of the linear ``step``."""
  indices = []
  for size in reversed(grid):
    indices.append(lax.rem(step, _i32(size)))
    step = lax.div(step, _i32(size))
  return tuple(reversed(indices))


def _any_steps(num_steps: GridEntry) -> bool | jax.Array:
  """Whether the grid has a step (always, for a static grid)."""
  return True if _is_static(num_steps) else num_steps > 0


def _when(condition: bool | jax.Array, fn: Callable[[], None]) -> None:
  """``pl.when`` that folds a static condition at trace time."""
  if isinstance(condition, (bool, np.bool_)):
    if condition:
      fn()
  else:
    pl.when(condition)(fn)


# ---------------------------------------------------------------------------
# Block specs
# ---------------------------------------------------------------------------

_BLOCKED, _ELEMENT, _SQUEEZED = "blocked", "element", "squeezed"


@dataclasses.dataclass(frozen=True)
class _Dim:
  """One block dimension: how its index becomes a GMEM window."""

  kind: str  # _BLOCKED, _ELEMENT or _SQUEEZED.
  size: int  # Elements in the window (1 when squeezed).

  def window(self, index: jax.Array):
    if self.kind == _BLOCKED:
      return pl.ds(index * self.size, self.size)
    if self.kind == _ELEMENT:
      return pl.ds(index, self.size)
    return index  # An integer index drops the dimension.


def _make_dim(where: str, dim: Any) -> _Dim:
  if dim is None or isinstance(dim, pl.Squeezed):
    return _Dim(_SQUEEZED, 1)
  if isinstance(dim, pl.Blocked):
    dim = dim.block_size
  if isinstance(dim, pl.Element):
    if tuple(dim.padding) != (0, 0):
      raise NotImplementedError(
        f"{where}: pl.Element block dimensions with padding are not "
        f"supported, got padding={dim.padding}"
      )
    kind, size = _ELEMENT, dim.block_size
  elif isinstance(dim, (int, np.integer)) and not isinstance(dim, bool):
    kind, size = _BLOCKED, dim
  elif isinstance(dim, pl.BoundedSlice):
    raise NotImplementedError(
      f"{where}: pl.BoundedSlice block dimensions are not supported"
    )
  else:
    raise TypeError(
      f"{where}: expected block dimensions as ints, pl.Blocked, pl.Element, "
      f"pl.Squeezed or None, got {dim!r}"
    )
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
    raise TypeError(f"{where}: expected an int block size, got {size!r}")
  if size <= 0:
    raise ValueError(f"{where}: expected positive block sizes, got {size}")
  return _Dim(kind, int(size))


@dataclasses.dataclass(frozen=True)
class _Operand:
  """A validated block spec of one pipeline operand."""

  in_smem: bool  # False: the whole GMEM ref is passed to the body.
  dims: tuple[_Dim, ...] | None  # None: one block, the whole operand.
  index_map: Callable[..., Any] | None  # None: always block (0, ...).
  transforms: tuple[Any, ...]
  delay_release: int
  invariant: bool  # The block does not depend on the grid indices.

  def resolve(self, shape: Sequence[int]) -> tuple[_Dim, ...]:
    if self.dims is None:
      return tuple(_Dim(_BLOCKED, int(s)) for s in shape)
    return self.dims

  def smem_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(d.size for d in self.resolve(shape) if d.kind != _SQUEEZED)

  def block_indices(self, indices, ndim: int) -> tuple[jax.Array, ...]:
    if self.index_map is None:
      return (jnp.int32(0),) * ndim
    out = self.index_map(*indices)
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) != ndim:
      raise ValueError(
        f"pipeline: expected index_map to return {ndim} block indices (one "
        f"per block dim), got {len(out)}"
      )
    return tuple(jnp.asarray(i).astype(jnp.int32) for i in out)

  def gmem_block(self, gmem_ref, indices):
    dims = self.resolve(gmem_ref.shape)
    windows = tuple(
      d.window(i)
      for d, i in zip(dims, self.block_indices(indices, len(dims)), strict=True)
    )
    return gmem_ref.at[windows]

  def copy_in(self, gmem_ref, indices, smem_ref, barrier_ref) -> None:
    plgpu.copy_gmem_to_smem(
      self.gmem_block(gmem_ref, indices), smem_ref, barrier_ref
    )

  def smem(self, slots: int, ref_type: Any) -> Any:
    return plgpu.SMEM(
      (slots, *self.smem_shape(ref_type.shape)),
      ref_type.dtype,
      transforms=self.transforms,
    )


def _depends_on_indices(index_map: Callable[..., Any], ndim: int) -> bool:
  """Whether any block index returned by ``index_map`` uses a grid index."""
  index_aval = jax.ShapeDtypeStruct((), jnp.int32)
  jaxpr = jax.make_jaxpr(index_map)(*(index_aval,) * ndim).jaxpr
  dependent = set(jaxpr.invars)

  def uses(v):
    return not isinstance(v, jex_core.Literal) and v in dependent

  for eqn in jaxpr.eqns:
    # Conservative for nested jaxprs: any dependent input taints every output.
    if any(map(uses, eqn.invars)):
      dependent.update(eqn.outvars)
  return any(map(uses, jaxpr.outvars))


def _in_smem(where: str, memory_space: Any) -> bool:
  if memory_space in (None, plgpu.SMEM, pl.MemorySpace.DEFAULT):
    return True
  if memory_space in (plgpu.GMEM, pl.MemorySpace.ANY):
    return False
  raise ValueError(
    f"{where}: expected memory_space SMEM (copied block by block) or "
    f"GMEM (passed through), got {memory_space}"
  )


def _make_operand(where: str, spec: Any, grid: tuple[GridEntry, ...]):
  if not isinstance(spec, pl.BlockSpec):
    raise TypeError(
      f"{where}: expected a pl.BlockSpec or plgpu.BlockSpec, got "
      f"{type(spec).__name__}"
    )
  in_smem = _in_smem(where, spec.memory_space)
  if spec.pipeline_mode is not None:
    raise NotImplementedError(
      f"{where}: pipeline_mode is not supported; use max_concurrent_steps"
    )
  if getattr(spec, "collective_axes", ()):
    raise NotImplementedError(
      f"{where}: collective_axes (cluster multicast) is not supported"
    )
  delay_release = getattr(spec, "delay_release", 0)
  if isinstance(delay_release, bool) or not isinstance(delay_release, int):
    raise TypeError(
      f"{where}: expected delay_release to be an int, got {delay_release!r}"
    )
  if delay_release < 0:
    raise ValueError(
      f"{where}: expected delay_release >= 0, got {delay_release}"
    )
  if not in_smem:
    return _Operand(False, None, None, (), 0, True)
  dims = None
  if spec.block_shape is not None:
    dims = tuple(_make_dim(where, d) for d in spec.block_shape)
  index_map = spec.index_map
  invariant = index_map is None or not _depends_on_indices(index_map, len(grid))
  return _Operand(
    in_smem=True,
    dims=dims,
    index_map=index_map,
    transforms=tuple(getattr(spec, "transforms", ())),
    delay_release=delay_release,
    invariant=invariant,
  )


def _make_operands(where, specs, grid, kind) -> tuple[_Operand, ...]:
  # A lone spec stands for a one-element sequence (as upstream accepts).
  if isinstance(specs, pl.BlockSpec):
    specs = (specs,)
  return tuple(
    _make_operand(f"{where}: {kind}[{i}]", s, grid) for i, s in enumerate(specs)
  )


def _check_steps(where: str, max_concurrent_steps: Any) -> int:
  if (
    isinstance(max_concurrent_steps, bool)
    or not isinstance(max_concurrent_steps, int)
    or max_concurrent_steps < 1
  ):
    raise ValueError(
      f"{where}: expected 'max_concurrent_steps' an int >= 1, got "
      f"{max_concurrent_steps!r}"
    )
  return max_concurrent_steps


def _check_refs(
  where: str, operands: Sequence[_Operand], refs: Sequence[Any], kind: str
) -> None:
  if len(operands) != len(refs):
    raise ValueError(
      f"{where}: expected {len(operands)} {kind} refs (one per spec), got "
      f"{len(refs)}"
    )
  for i, (op, ref) in enumerate(zip(operands, refs, strict=True)):
    if not op.in_smem or op.dims is None:
      continue
    shape = tuple(ref.shape)
    if len(shape) != len(op.dims):
      raise ValueError(
        f"{where}: {kind}[{i}] expected rank {len(op.dims)} (one dim per "
        f"block dim), got shape {shape}"
      )
    block = tuple(d.size if d.kind != _SQUEEZED else None for d in op.dims)
    for d, s in zip(op.dims, shape, strict=True):
      if d.kind == _BLOCKED and s % d.size:
        raise ValueError(
          f"{where}: {kind}[{i}] expected a shape divisible by its "
          f"block_shape {block}, got {shape}"
        )
      if d.size > s:
        raise ValueError(
          f"{where}: {kind}[{i}] expected a shape at least its block_shape "
          f"{block}, got {shape}"
        )


# ---------------------------------------------------------------------------
# Shared schedule pieces
# ---------------------------------------------------------------------------


def _differs(a: Sequence[jax.Array], b: Sequence[jax.Array]) -> jax.Array:
  return functools.reduce(
    jnp.logical_or,
    (x != y for x, y in zip(a, b, strict=True)),
    jnp.bool_(False),
  )


class _Outputs:
  """Stores output blocks when their block index changes.

  A run is a maximal range of consecutive steps with the same output block.
  All steps of a run see the same SMEM buffer (so the body may accumulate);
  the block is stored once, after the last step of its run. Runs alternate
  between two buffers so that a store overlaps the next run.
  """

  def __init__(self, operands, gmem_refs, smem_refs, grid):
    self.operands = operands
    self.gmem_refs = gmem_refs
    self.smem_refs = smem_refs
    self.grid = grid
    self.num_steps = _num_steps(grid)
    self.streamed = [op.in_smem and not op.invariant for op in self.operands]

  def init_runs(self):
    return tuple(jnp.int32(0) for _ in self.operands)

  def body_refs(self, runs):
    refs = []
    for op, gmem, smem, run in zip(
      self.operands, self.gmem_refs, self.smem_refs, runs, strict=True
    ):
      if not op.in_smem:
        refs.append(gmem)
      elif op.invariant:
        refs.append(smem.at[0])
      else:
        refs.append(smem.at[lax.rem(run, jnp.int32(_OUTPUT_SLOTS))])
    return refs

  def before_body(self):
    if any(self.streamed):
      # The buffer this run writes was stored two runs ago: every store but
      # the newest must have finished reading SMEM.
      plgpu.wait_smem_to_gmem(_OUTPUT_SLOTS - 1, wait_read_only=True)

  def after_body(self, step, indices, runs):
    """Stores the blocks whose run ends at ``step``; returns the new runs."""
    if not any(self.streamed):
      return runs
    plgpu.commit_smem()
    last = _i32(self.num_steps) - 1
    next_indices = _unravel(jnp.minimum(step + 1, last), self.grid)
    new_runs = []
    for op, gmem, smem, run, streamed in zip(
      self.operands,
      self.gmem_refs,
      self.smem_refs,
      runs,
      self.streamed,
      strict=True,
    ):
      if not streamed:
        new_runs.append(run)
        continue
      ndim = len(op.resolve(gmem.shape))
      ends = jnp.logical_or(
        step == last,
        _differs(
          op.block_indices(indices, ndim),
          op.block_indices(next_indices, ndim),
        ),
      )
      slot = lax.rem(run, jnp.int32(_OUTPUT_SLOTS))

      @pl.when(ends)
      def _store(op=op, gmem=gmem, smem=smem, slot=slot):
        plgpu.copy_smem_to_gmem(smem.at[slot], op.gmem_block(gmem, indices))
        plgpu.commit_smem_to_gmem_group()

      new_runs.append(run + ends.astype(jnp.int32))
    return tuple(new_runs)

  def finish(self):
    """Stores the index-invariant outputs and waits for every store."""
    invariant = [
      (op, gmem, smem)
      for op, gmem, smem in zip(
        self.operands, self.gmem_refs, self.smem_refs, strict=True
      )
      if op.in_smem and op.invariant
    ]

    def store():
      plgpu.commit_smem()
      zeros = (jnp.int32(0),) * len(self.grid)
      for op, gmem, smem in invariant:
        plgpu.copy_smem_to_gmem(smem.at[0], op.gmem_block(gmem, zeros))
      plgpu.commit_smem_to_gmem_group()

    if invariant:
      # A traced grid may have no steps: the body never wrote the block.
      _when(_any_steps(self.num_steps), store)
    if invariant or any(self.streamed):
      plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------
# Software pipeline (one mesh)
# ---------------------------------------------------------------------------


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
  grid = _check_grid(where, grid)
  max_concurrent_steps = _check_steps(where, max_concurrent_steps)
  ins = _make_operands(where, in_specs, grid, "in_specs")
  outs = _make_operands(where, out_specs, grid, "out_specs")
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
  num_steps = _num_steps(grid)
  slots = _slots(max_concurrent_steps, num_steps)
  streamed = [op.in_smem and not op.invariant for op in ins]
  once = [op.in_smem and op.invariant for op in ins]

  def run(*gmem_refs):
    in_refs, out_refs = gmem_refs[: len(ins)], gmem_refs[len(ins) :]
    _check_refs(where, ins, in_refs, "input")
    _check_refs(where, outs, out_refs, "output")
    scratch = dict(
      in_smem=[
        op.smem(slots if s else 1, ref) if op.in_smem else None
        for op, ref, s in zip(ins, in_refs, streamed, strict=True)
      ],
      out_smem=[
        op.smem(1 if op.invariant else _OUTPUT_SLOTS, ref)
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
      indices = _unravel(step, grid)
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
        _when(
          _is_static(num_steps) or step < num_steps,
          functools.partial(fetch, jnp.int32(step)),
        )
    if loaded_once is not None:
      plgpu.barrier_wait(loaded_once)

    outputs = _Outputs(outs, out_gmem, out_smem, grid)
    delays = sorted(
      {op.delay_release for op, s in zip(ins, streamed, strict=True) if s}
    )

    def step_fn(step, carry):
      runs, body_carry = carry
      indices = _unravel(step, grid)
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
      final_carry = _run_once(where, compute_context, loop)
    else:
      final_carry = loop(init_carry)
    outputs.finish()
    return final_carry

  return run


def _run_once(where: str, compute_context, loop) -> Any:
  """Calls ``compute_context(run)``, checking that it runs ``loop`` once."""
  calls = []

  def run(init_carry):
    if calls:
      raise ValueError(
        f"{where}: compute_context must run the pipeline exactly once, got "
        "a second call"
      )
    calls.append(True)
    return loop(init_carry)

  compute_context(run)
  if not calls:
    raise ValueError(
      f"{where}: compute_context must run the pipeline exactly once, got no "
      "call"
    )


# ---------------------------------------------------------------------------
# Warp-specialized pipeline (a memory mesh and a compute mesh)
# ---------------------------------------------------------------------------


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
  ins: tuple[_Operand, ...]
  outs: tuple[_Operand, ...]
  slots: int
  delay_release: int
  num_compute_wgs: int
  manual_consumed_barriers: bool
  compute_context: Callable[..., Any] | None
  memory_registers: int | None
  manual_produced_barriers: bool = False

  @property
  def num_steps(self) -> GridEntry:
    return _num_steps(self.grid)

  @property
  def _streamed(self) -> list[bool]:
    return [op.in_smem and not op.invariant for op in self.ins]

  @property
  def _once(self) -> list[bool]:
    return [op.in_smem and op.invariant for op in self.ins]

  @property
  def _synced(self) -> bool:
    """Whether the meshes meet through barriers at every step."""
    return (
      any(self._streamed)
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
    _check_refs(where, self.ins, in_types, "input")
    _check_refs(where, self.outs, out_types, "output")
    streamed, once = self._streamed, self._once
    if self.manual_produced_barriers:
      # One barrier per input; the body waits on them itself.
      loaded = [plgpu.Barrier(num_barriers=self.slots) for _ in self.ins]
    elif any(streamed):
      loaded = [
        plgpu.Barrier(num_arrivals=sum(streamed), num_barriers=self.slots)
      ]
    else:
      loaded = []
    num_consumed = len(self.ins) if self.manual_consumed_barriers else 1
    return dict(
      in_smem=[
        op.smem(self.slots if s else 1, t) if op.in_smem else None
        for op, t, s in zip(self.ins, in_types, streamed, strict=True)
      ],
      out_smem=[
        op.smem(1 if op.invariant else _OUTPUT_SLOTS, t) if op.in_smem else None
        for op, t in zip(self.outs, out_types, strict=True)
      ],
      loaded=loaded,
      loaded_once=plgpu.Barrier(num_arrivals=sum(once)) if any(once) else None,
      consumed=[
        plgpu.Barrier(
          num_arrivals=self.num_compute_wgs, num_barriers=self.slots
        )
        for _ in range(num_consumed)
      ]
      if self._synced
      else [],
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
    prologue, quiesce = _pipeline_state_flags(
      "warp_specialized_pipeline", self, pipeline_state
    )
    if self.memory_registers is not None:
      plgpu.set_max_registers(self.memory_registers, action="decrease")
    in_gmem = gmem_refs[: len(self.ins)]
    _check_refs("warp_specialized_pipeline", self.ins, in_gmem, "input")
    zeros = (jnp.int32(0),) * len(self.grid)
    for op, gmem, smem, o in zip(
      self.ins, in_gmem, scratch["in_smem"], self._once, strict=True
    ):
      if o:
        op.copy_in(gmem, zeros, smem.at[0], scratch["loaded_once"])
    if not self._synced:
      return
    produced, consumed = scratch["loaded"], scratch["consumed"]
    num_steps, slots = self.num_steps, self.slots
    manual_consumed = self.manual_consumed_barriers

    def fetch(step, wait):
      """Loads ``step`` into its slot, after the slot's last reader if
      ``wait``."""
      indices = _unravel(step, self.grid)
      slot = lax.rem(step, jnp.int32(slots))
      if wait and not manual_consumed:
        plgpu.barrier_wait(consumed[0].at[slot])
      for i, (op, gmem, smem, s) in enumerate(
        zip(self.ins, in_gmem, scratch["in_smem"], self._streamed, strict=True)
      ):
        if wait and manual_consumed:
          plgpu.barrier_wait(consumed[i].at[slot])
        if self.manual_produced_barriers:
          barrier = produced[i].at[slot]
          if not s:
            # Nothing to copy, but the body waits on every input's barrier.
            plgpu.barrier_arrive(barrier)
        else:
          barrier = produced[0].at[slot] if produced else None
        if s:
          op.copy_in(gmem, indices, smem.at[slot], barrier)

    def fill():
      for step in range(slots):
        # A traced grid may have fewer steps than slots.
        _when(
          _is_static(num_steps) or step < num_steps,
          functools.partial(fetch, jnp.int32(step), False),
        )

    _when(prologue, fill)
    if _is_static(num_steps):
      filled = min(slots, num_steps)
    else:
      filled = lax.min(jnp.int32(slots), num_steps)
    if isinstance(prologue, bool):
      first = filled if prologue else 0
    else:
      first = jnp.where(prologue, _i32(filled), jnp.int32(0))

    def refill(step, carry):
      fetch(step, True)
      return carry

    lax.fori_loop(first, num_steps, refill, None)

    def drain():
      # Observe the last releases so that no barrier is left mid-phase.
      def observe(step, carry):
        slot = lax.rem(step, jnp.int32(slots))
        for barrier in consumed:
          plgpu.barrier_wait(barrier.at[slot])
        return carry

      lax.fori_loop(
        num_steps - filled, num_steps - self.delay_release, observe, None
      )

    _when(quiesce, drain)

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
    _check_refs(where, self.ins, in_gmem, "input")
    _check_refs(where, self.outs, out_gmem, "output")
    streamed = self._streamed
    if scratch["loaded_once"] is not None:
      plgpu.barrier_wait(scratch["loaded_once"])
    outputs = _Outputs(self.outs, out_gmem, scratch["out_smem"], self.grid)
    has_carry = self.compute_context is not None
    produced, consumed = scratch["loaded"], scratch["consumed"]
    delay = self.delay_release

    def step_fn(step, carry):
      runs, body_carry = carry
      indices = _unravel(step, self.grid)
      slot = lax.rem(step, jnp.int32(self.slots))
      # The slot that step ``step - delay`` read, released after this body.
      released = lax.rem(jnp.maximum(step - delay, 0), jnp.int32(self.slots))
      if produced and not self.manual_produced_barriers:
        plgpu.barrier_wait(produced[0].at[slot])
      outputs.before_body()
      blocks = []
      for op, gmem, smem, s in zip(
        self.ins, in_gmem, scratch["in_smem"], streamed, strict=True
      ):
        blocks.append(smem.at[slot if s else 0] if op.in_smem else gmem)
      blocks += outputs.body_refs(runs)
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

        _when(delay == 0 or step >= delay, release)
      return outputs.after_body(step, indices, runs), new_carry

    def loop(carry=None):
      _, final = lax.fori_loop(
        0, self.num_steps, step_fn, (outputs.init_runs(), carry)
      )
      return final

    if has_carry:
      _run_once(where, self.compute_context, loop)
    else:
      loop()
    outputs.finish()


def _pipeline_state_flags(
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
  if not _is_static(pipe.num_steps):
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
  if any(pipe._once):
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


def _warp_specialized(
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
  grid = _check_grid(where, grid)
  max_concurrent_steps = _check_steps(where, max_concurrent_steps)
  if (
    isinstance(num_compute_wgs, bool)
    or not isinstance(num_compute_wgs, int)
    or num_compute_wgs < 1
  ):
    raise ValueError(
      f"{where}: expected 'num_compute_wgs' an int >= 1, got "
      f"{num_compute_wgs!r}"
    )
  _check_registers(where, memory_registers)
  ins = _make_operands(where, in_specs, grid, "in_specs")
  outs = _make_operands(where, out_specs, grid, "out_specs")
  delays = {op.delay_release for op in ins if op.in_smem and not op.invariant}
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
    slots=_slots(max_concurrent_steps, _num_steps(grid)),
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
  return _warp_specialized(
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


# ---------------------------------------------------------------------------
# Assembling the mpmd_map call
# ---------------------------------------------------------------------------

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
  num_compute = pipe.num_compute_wgs
  if multi_mesh:
    compute_mesh = plgpu.Mesh(
      grid=grid,
      grid_names=grid_names,
      num_threads=num_compute,
      thread_name=COMPUTE_AXIS,
    )
    memory_mesh = plgpu.Mesh(
      grid=grid, grid_names=grid_names, num_threads=1, thread_name=MEMORY_AXIS
    )

    def compute_kernel(*refs):
      *refs, scratch = refs
      compute_fn(*refs, scratch, lax.axis_index(COMPUTE_AXIS))

    def memory_kernel(*refs):
      *refs, scratch = refs
      memory_fn(*refs, scratch)

    return mpmd.mpmd_map(
      [(compute_mesh, compute_kernel), (memory_mesh, memory_kernel)],
      out_types=out_types,
      scratch_types=(scratch_types,),
      compiler_params=compiler_params,
      interpret=interpret,
      name=name,
    )

  mesh = plgpu.Mesh(
    grid=grid,
    grid_names=grid_names,
    num_threads=num_compute + 1,
    thread_name=SINGLE_MESH_AXIS,
  )

  def kernel(*refs):
    *refs, scratch = refs
    wg = lax.axis_index(SINGLE_MESH_AXIS)
    lax.cond(
      wg < num_compute,
      lambda: compute_fn(*refs, scratch, wg),
      lambda: memory_fn(*refs, scratch),
    )

  return mpmd.mpmd_map(
    [(mesh, kernel)],
    out_types=out_types,
    scratch_types=(scratch_types,),
    compiler_params=compiler_params,
    interpret=interpret,
    name=name,
  )
