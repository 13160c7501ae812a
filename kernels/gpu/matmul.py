"""Hopper-style tiled matmul on the pipelines of ``mpmd.kernels.gpu``.

Each CTA of an ``(M // block_m, N // block_n)`` grid computes one output tile.
The K dimension is the pipeline's sequential grid: TMA copies bring
``(block_m, block_k)`` tiles of ``a`` and ``(block_k, block_n)`` tiles of ``b``
into swizzled SMEM, WGMMA accumulates them into an f32 register accumulator,
and the tile is stored through SMEM with a TMA copy.

* ``warp_specialized=False``: one warpgroup per CTA runs the software pipeline
  (:func:`mpmd.kernels.gpu.pipeline`).
* ``warp_specialized=True``: ``mpmd_map`` gets two meshes, a memory mesh of one
  warpgroup issuing the TMA copies and a compute mesh of ``num_compute_wgs``
  warpgroups, each computing a ``block_n // num_compute_wgs`` wide slice of
  the tile (:func:`mpmd.kernels.gpu.warp_specialized_pipeline`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from mpmd.kernels._common import (
  as_dtype,
  check_array,
  check_bool,
  check_dtype,
  check_int,
  operand_names,
  out_type,
  varying_axes,
)
from mpmd.kernels.gpu.launch import warp_specialized_kernel
from mpmd.kernels.gpu.pipeline import pipeline
from mpmd.kernels.gpu.warp_specialized import warp_specialized_pipeline
from mpmd.types import Interpret

INPUT_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
OUTPUT_DTYPES = (*INPUT_DTYPES, jnp.dtype(jnp.float32))
# One warpgroup's WGMMA covers 64 rows; N and K tiles must cover whole
# swizzle atoms of SMEM (128 bytes of a row at the widest swizzle).
WGMMA_M = 64
SWIZZLE_BYTES = 128
# Hopper (sm_90) shared memory per CTA available to a kernel.
SMEM_BYTES = 227 * 1024

GRID_NAMES = ("m", "n")
# The warp-specialized matmul's default form: two meshes (memory, compute).
# False selects the single-mesh form of the same schedule (one mesh whose
# threads branch on their index), kept to compare the two.
MULTI_MESH_DEFAULT = True


def _swizzle_transforms(minor_elems: int, dtype) -> tuple[Any, ...]:
  """Tiling + swizzle of an SMEM tile whose rows hold ``minor_elems``."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
  return (
    plgpu.TilingTransform((8, swizzle // itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )


@dataclasses.dataclass(frozen=True)
class _Config:
  m: int
  n: int
  k: int
  block_m: int
  block_n: int
  block_k: int
  max_concurrent_steps: int
  warp_specialized: bool
  num_compute_wgs: int
  in_dtype: np.dtype
  out_dtype: np.dtype
  # Manual mesh axes the operands vary over (inside a shard_map).
  varying: frozenset[Hashable] = frozenset()

  @property
  def wg_n(self) -> int:
    if self.warp_specialized:
      return self.block_n // self.num_compute_wgs
    return self.block_n

  @property
  def k_steps(self) -> int:
    return self.k // self.block_k


def _check_operands(
  fn: str, a: Any, b: Any, c: Any, out_dtype: DTypeLike | None
) -> tuple[np.dtype, np.dtype]:
  """(a's dtype, the output dtype); raises on bad operands."""
  check_array(fn, "a", a, rank=2, shape_doc="(m, k)")
  check_array(fn, "b", b, rank=2, shape_doc="(k, n)")
  in_dtype = check_dtype(fn, "a", a, INPUT_DTYPES)
  if jnp.dtype(b.dtype) != in_dtype:
    raise TypeError(
      f"{fn}: expected 'b' of the dtype of 'a' ({in_dtype.name}), got "
      f"{jnp.dtype(b.dtype).name}"
    )
  (m, k), (k_b, n) = a.shape, b.shape
  if k != k_b:
    raise ValueError(
      f"{fn}: expected 'b' with {k} rows (the columns of 'a'), got "
      f"shape {tuple(b.shape)}"
    )
  out_dtype = as_dtype(
    fn, "out_dtype", in_dtype if out_dtype is None else out_dtype, OUTPUT_DTYPES
  )
  if c is not None:
    check_array(fn, "c", c, rank=2, shape_doc="(m, n)")
    if tuple(c.shape) != (m, n):
      raise ValueError(
        f"{fn}: expected 'c' of shape (m, n) = {(m, n)}, got shape "
        f"{tuple(c.shape)}"
      )
    check_dtype(fn, "c", c, (out_dtype,))
  return in_dtype, out_dtype


def check_config(
  fn: str,
  a: Any,
  b: Any,
  *,
  c: Any = None,
  block_m: int,
  block_n: int,
  block_k: int,
  max_concurrent_steps: int,
  warp_specialized: bool,
  num_compute_wgs: int,
  out_dtype: DTypeLike | None,
) -> _Config:
  """Validates the operands and blocks of the public function ``fn``;
  raises before anything is traced."""
  in_dtype, out_dtype = _check_operands(fn, a, b, c, out_dtype)
  warp_specialized = check_bool(fn, "warp_specialized", warp_specialized)
  num_compute_wgs = check_int(fn, "num_compute_wgs", num_compute_wgs)
  max_concurrent_steps = check_int(
    fn, "max_concurrent_steps", max_concurrent_steps
  )
  atom = SWIZZLE_BYTES // in_dtype.itemsize
  atom_doc = f"a {SWIZZLE_BYTES}-byte swizzle atom"
  wgs = num_compute_wgs if warp_specialized else 1
  block_m = check_int(
    fn, "block_m", block_m, multiple_of=WGMMA_M, why="one warpgroup's WGMMA"
  )
  block_n = check_int(
    fn,
    "block_n",
    block_n,
    multiple_of=atom * wgs,
    why=atom_doc if wgs == 1 else f"{atom_doc} for each of {wgs} warpgroups",
  )
  block_k = check_int(fn, "block_k", block_k, multiple_of=atom, why=atom_doc)
  (m, k), n = a.shape, b.shape[1]
  for dim, size, block in (
    ("M", m, block_m),
    ("N", n, block_n),
    ("K", k, block_k),
  ):
    if size % block:
      raise ValueError(
        f"{fn}: expected {dim}={size} to be a multiple of "
        f"block_{dim.lower()}={block}, got remainder {size % block}"
      )
  config = _Config(
    m=m,
    n=n,
    k=k,
    block_m=block_m,
    block_n=block_n,
    block_k=block_k,
    max_concurrent_steps=min(max_concurrent_steps, k // block_k),
    warp_specialized=warp_specialized,
    num_compute_wgs=num_compute_wgs,
    in_dtype=in_dtype,
    out_dtype=out_dtype,
    varying=varying_axes(a, b, *([] if c is None else [c])),
  )
  smem = _smem_bytes(config, has_c=c is not None)
  if smem > SMEM_BYTES:
    raise ValueError(
      f"{fn}: expected blocks that fit the {SMEM_BYTES} bytes of shared "
      f"memory of a Hopper CTA, got blocks that need {smem} bytes; lower "
      "max_concurrent_steps or the block sizes"
    )
  return config


def _smem_bytes(config: _Config, has_c: bool) -> int:
  in_size = config.in_dtype.itemsize
  out_size = config.out_dtype.itemsize
  stage = (config.block_m + config.block_n) * config.block_k * in_size
  tile = config.block_m * config.block_n * out_size
  return stage * config.max_concurrent_steps + tile * (1 + has_c)


Epilogue = Callable[[jax.Array, jax.Array | None], jax.Array]


def _default_epilogue(acc: jax.Array, c: jax.Array | None) -> jax.Array:
  return acc if c is None else acc + c


def _specs(config: _Config, has_c: bool):
  """Block specs over the K grid of one CTA's slices of a, b (and c)."""
  in_transforms = _swizzle_transforms(config.block_k, config.in_dtype)
  b_transforms = _swizzle_transforms(config.wg_n, config.in_dtype)
  specs = [
    plgpu.BlockSpec(
      (config.block_m, config.block_k),
      lambda k: (0, k),
      transforms=in_transforms,
    ),
    plgpu.BlockSpec(
      (config.block_k, config.block_n),
      lambda k: (k, 0),
      transforms=b_transforms,
    ),
  ]
  if has_c:
    # Index-invariant over K: loaded once per tile, before the first step.
    specs.append(
      plgpu.BlockSpec(
        (config.block_m, config.block_n),
        lambda k: (0, 0),
        transforms=_swizzle_transforms(config.wg_n, config.out_dtype),
      )
    )
  return specs


def _cta_slices(config: _Config):
  mi, ni = (lax.axis_index(name) for name in GRID_NAMES)
  return (
    pl.ds(mi * config.block_m, config.block_m),
    pl.ds(ni * config.block_n, config.block_n),
  )


def _software_kernel(config: _Config, epilogue: Epilogue, has_c: bool):
  out_spec = plgpu.BlockSpec(
    (config.block_m, config.block_n),
    lambda k: (0, 0),
    transforms=_swizzle_transforms(config.block_n, config.out_dtype),
  )
  last = config.k_steps - 1

  @operand_names(("a_ref", "b_ref", *("c_ref",) * has_c, "o_ref"))
  def kernel(a_ref, b_ref, *refs):
    *c_ref, o_ref = refs
    m_slice, n_slice = _cta_slices(config)
    operands = [a_ref.at[m_slice, :], b_ref.at[:, n_slice]]
    operands += [c.at[m_slice, n_slice] for c in c_ref]

    def body(indices, a_smem, b_smem, *blocks):
      *c_smem, o_smem, acc = blocks
      plgpu.wgmma(acc, a_smem, b_smem)
      plgpu.wgmma_wait(0)

      @pl.when(indices[0] == last)
      def _epilogue():
        c_val = c_smem[0][...].astype(jnp.float32) if c_smem else None
        o_smem[...] = epilogue(acc[...], c_val).astype(o_smem.dtype)

      return acc

    def context(run):
      def with_acc(acc):
        run(acc)  # The final carry is the accumulator ref: not returned.

      pl.run_scoped(
        with_acc, plgpu.ACC((config.block_m, config.block_n), jnp.float32)
      )

    pipeline(
      body,
      grid=(config.k_steps,),
      in_specs=_specs(config, has_c),
      out_specs=[out_spec],
      max_concurrent_steps=config.max_concurrent_steps,
      compute_context=context,
    )(*operands, o_ref.at[m_slice, n_slice])

  return kernel


def _ws_pipeline(config: _Config, has_c: bool):
  # Placeholder body and context: each compute warpgroup passes its own to
  # ``compute`` (the allocations and the memory side do not depend on them).
  return warp_specialized_pipeline(
    lambda *args: args[-1],
    grid=(config.k_steps,),
    in_specs=_specs(config, has_c),
    max_concurrent_steps=config.max_concurrent_steps,
    num_compute_wgs=config.num_compute_wgs,
    compute_context=lambda run: None,
  )


def _ws_scratch(config: _Config, has_c: bool):
  pipe = _ws_pipeline(config, has_c)
  operand_types = [
    jax.ShapeDtypeStruct((config.block_m, config.k), config.in_dtype),
    jax.ShapeDtypeStruct((config.k, config.block_n), config.in_dtype),
  ]
  if has_c:
    operand_types.append(
      jax.ShapeDtypeStruct((config.block_m, config.block_n), config.out_dtype)
    )
  return dict(
    pipeline=pipe.scratch_types(*operand_types),
    out_smem=plgpu.SMEM(
      (config.num_compute_wgs, config.block_m, config.wg_n),
      config.out_dtype,
      transforms=_swizzle_transforms(config.wg_n, config.out_dtype),
    ),
  )


def _ws_fns(config: _Config, epilogue: Epilogue, has_c: bool):
  """The compute and memory functions of the warp-specialized matmul."""
  wg_n = config.wg_n

  def operands(a_ref, b_ref, c_ref):
    m_slice, n_slice = _cta_slices(config)
    ops = [a_ref.at[m_slice, :], b_ref.at[:, n_slice]]
    ops += [c.at[m_slice, n_slice] for c in c_ref]
    return ops, m_slice, n_slice

  names = ("a_ref", "b_ref", *("c_ref",) * has_c, "o_ref", "scratch")

  @operand_names((*names, "wg"))
  def compute_fn(a_ref, b_ref, *refs):
    *c_ref, o_ref, scratch, wg = refs
    ops, m_slice, n_slice = operands(a_ref, b_ref, c_ref)
    wg_slice = pl.ds(wg * wg_n, wg_n)
    out_smem = scratch["out_smem"].at[wg]

    def body(indices, a_smem, b_smem, *rest):
      *c_smem, acc = rest
      plgpu.wgmma(acc, a_smem, b_smem.at[:, wg_slice])
      plgpu.wgmma_wait(0)

      @pl.when(indices[0] == config.k_steps - 1)
      def _epilogue():
        c_val = (
          c_smem[0].at[:, wg_slice][...].astype(jnp.float32) if c_smem else None
        )
        out_smem[...] = epilogue(acc[...], c_val).astype(out_smem.dtype)

      return acc

    def context(run):
      def with_acc(acc):
        run(acc)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
          out_smem, o_ref.at[m_slice, n_slice].at[:, wg_slice]
        )
        plgpu.wait_smem_to_gmem(0)

      pl.run_scoped(with_acc, plgpu.ACC((config.block_m, wg_n), jnp.float32))

    _ws_pipeline(config, has_c).compute(
      *ops, scratch=scratch["pipeline"], body=body, compute_context=context
    )

  @operand_names(names)
  def memory_fn(a_ref, b_ref, *refs):
    *c_ref, _, scratch = refs
    ops, _, _ = operands(a_ref, b_ref, c_ref)
    _ws_pipeline(config, has_c).memory(*ops, scratch=scratch["pipeline"])

  return compute_fn, memory_fn


def build(
  config: _Config,
  *,
  epilogue: Epilogue = _default_epilogue,
  has_c: bool = False,
  multi_mesh: bool = MULTI_MESH_DEFAULT,
  interpret: Interpret = None,
  name: str = "matmul",
) -> Callable[..., jax.Array]:
  """The ``mpmd_map`` callable of a validated config: ``f(a, b[, c])``."""
  import mpmd  # The kernels package is imported by mpmd; resolve late.

  grid = (config.m // config.block_m, config.n // config.block_n)
  out = out_type((config.m, config.n), config.out_dtype, config.varying)
  if config.warp_specialized:
    compute_fn, memory_fn = _ws_fns(config, epilogue, has_c)
    return warp_specialized_kernel(
      _ws_pipeline(config, has_c),
      compute_fn=compute_fn,
      memory_fn=memory_fn,
      out_types=out,
      scratch_types=_ws_scratch(config, has_c),
      grid=grid,
      grid_names=GRID_NAMES,
      multi_mesh=multi_mesh,
      interpret=interpret,
      name=f"{name}_ws",
    )
  # One warpgroup per CTA and no thread axis: the pipeline's SMEM scope is
  # the CTA's own, with no collective to name.
  mesh = plgpu.Mesh(grid=grid, grid_names=GRID_NAMES)
  return mpmd.mpmd_map(
    [(mesh, _software_kernel(config, epilogue, has_c))],
    out_types=out,
    interpret=interpret,
    name=name,
  )


def matmul(
  a: jax.Array,
  b: jax.Array,
  *,
  block_m: int = 128,
  block_n: int = 128,
  block_k: int = 64,
  max_concurrent_steps: int = 2,
  warp_specialized: bool = False,
  num_compute_wgs: int = 2,
  out_dtype: DTypeLike | None = None,
  interpret: Interpret = None,
  multi_mesh: bool = MULTI_MESH_DEFAULT,
) -> jax.Array:
  """``a @ b`` with TMA, swizzled SMEM and WGMMA, accumulated in f32.

  Args:
    a: ``(M, K)`` float16 or bfloat16.
    b: ``(K, N)``, the dtype of ``a``.
    block_m: rows of an output tile, a multiple of 64, dividing M.
    block_n: columns of an output tile, dividing N, a multiple of the
      swizzle atom (64 elements) times the compute warpgroups.
    block_k: depth of one pipeline step, a multiple of 64, dividing K.
    max_concurrent_steps: pipeline stages in flight (SMEM slots).
    warp_specialized: a memory mesh and a compute mesh instead of one mesh.
    num_compute_wgs: compute warpgroups when ``warp_specialized``; each
      computes ``block_n // num_compute_wgs`` columns of the tile.
    out_dtype: float16, bfloat16 or float32; defaults to the input dtype.
    interpret: None compiles with Mosaic GPU on a GPU and runs the Mosaic GPU
      simulator on CPU; otherwise passed to ``mpmd_map``.
    multi_mesh: with ``warp_specialized``, two meshes (memory, compute) in
      one ``mpmd_map``; False runs the same schedule as one mesh whose
      threads branch on their index (see ``MULTI_MESH_DEFAULT``).

  Returns:
    ``(M, N)`` array of ``out_dtype``.

  Example::

    a = jnp.ones((256, 128), jnp.float16)
    b = jnp.ones((128, 256), jnp.float16)
    c = matmul(a, b, warp_specialized=True)  # (256, 256) float16
  """
  config = check_config(
    "matmul",
    a,
    b,
    block_m=block_m,
    block_n=block_n,
    block_k=block_k,
    max_concurrent_steps=max_concurrent_steps,
    warp_specialized=warp_specialized,
    num_compute_wgs=num_compute_wgs,
    out_dtype=out_dtype,
  )
  return build(config, multi_mesh=multi_mesh, interpret=interpret)(a, b)
