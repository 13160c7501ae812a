"""gmm / tgmm on the CPU fallback vs jax.lax.ragged_dot and a dense matmul.

Every ratio is ours / reference, timed in the same run with rounds
interleaved (each round runs every side once, in a shuffled order) so that
load from other processes hits all sides alike; each side's time is its
median over rounds.
The dense ratios also come as the median of each round's ratio ("paired"),
steadier where the machine slows down for a stretch of rounds.

* gmm vs ``lax.ragged_dot`` and vs one dense ``(m, k) @ (k, n)`` matmul (the
  same useful FLOPs). Targets (issue #14): <= 0.3x ragged_dot, <= 1.5x dense.
* tgmm vs ``lax.ragged_dot_general`` with the ragged dimension contracted
  (the same computation), and vs the dense ``(k, m) @ (m, n)`` (<= 1.5x).
* both vs ``per-group dots``: one XLA dot per group over exactly its rows,
  with the group sizes fixed when traced (so not usable when sizes are
  data, as in a model). Any kernel that runs a dot per group pays the
  same fixed costs: on XLA:CPU a dot has a fixed cost per call (55-70 us
  at k=n=512, 2 cores), which seven non-empty groups pay seven times and
  the dense matmul once.
* "the window schedule in static XLA" / dense: the CPU schedule
  (``grouped_matmul.windows``: whole chunks and a tail window per group) as
  plain XLA with the sizes fixed when traced: the kernel's dots, window
  copies and stores, at offsets known when compiled and with no control
  flow. Not a floor: at the larger MoE case it took longer than tgmm.
* "tgmm's output alone" / dense: the dense dot, then its product stored
  into each group's slot of a ``(groups, k, n)`` f32 output that starts
  filled, one slot per step of a loop whose trip count is data. tgmm pays
  that fill and those stores on top of its per-group dots, window copies,
  masks and control flow: its group loop's output buffer starts filled
  (XLA:CPU has no unfilled buffer) and it stores each group's product once.

Cases: "ragged" has MoE-routing group sizes (not multiples of any tile, an
empty group); "dirichlet" draws friendlier uneven sizes; "moe-large" is a
larger Dirichlet case.
* forward + backward of a gmm loss vs the same with ragged_dot.

  python benchmarks/grouped_matmul.py            # the issue's shapes
  python benchmarks/grouped_matmul.py --quick    # small shapes, seconds
  mpmd bench grouped_matmul [--quick]

The targets printed are for the full "ragged" case; at --quick shapes a
loop step's fixed cost dominates and the ratios are larger.
"""

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from _timing import paired_ratio, time_rounds
from jax import lax

from mpmd.kernels import grouped_matmul as gm
from mpmd.kernels.grouped_matmul import _windows as windows


class Case(NamedTuple):
  name: str
  m: int
  k: int
  n: int
  groups: int
  dtype: str
  # Fixed group sizes; None draws Dirichlet shares.
  sizes: tuple[int, ...] | None = None


RAGGED = (100, 0, 200, 124, 300, 50, 150, 100)
QUICK_RAGGED = (25, 0, 50, 31, 75, 12, 38, 25)
FULL_CASES = (
  Case("ragged", 1024, 512, 512, 8, "float32", RAGGED),
  Case("ragged", 1024, 512, 512, 8, "bfloat16", RAGGED),
  Case("dirichlet", 1024, 512, 512, 8, "float32"),
  Case("dirichlet", 1024, 512, 512, 8, "bfloat16"),
  Case("moe-large", 4096, 768, 1024, 16, "bfloat16"),
)
QUICK_CASES = (
  Case("ragged", 256, 128, 128, 8, "float32", QUICK_RAGGED),
  Case("ragged", 256, 128, 128, 8, "bfloat16", QUICK_RAGGED),
  Case("dirichlet", 256, 128, 128, 4, "float32"),
)


def _group_sizes(rng: np.random.Generator, m: int, groups: int) -> np.ndarray:
  """Uneven MoE-like routing: Dirichlet shares, every row assigned."""
  shares = rng.dirichlet(np.full(groups, 2.0))
  sizes = np.floor(shares * m).astype(np.int32)
  sizes[np.argmax(sizes)] += m - sizes.sum()
  return sizes


class _Operands(NamedTuple):
  lhs: jax.Array  # (m, k)
  rhs: jax.Array  # (groups, k, n)
  dy: jax.Array  # (m, n), the loss's cotangent
  sizes: jax.Array  # (groups,) int32


def _operands(case: Case) -> _Operands:
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(case.dtype)
  m, k, n, g = case.m, case.k, case.n, case.groups
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  if case.sizes is None:
    sizes = jnp.asarray(_group_sizes(rng, m, g))
  else:
    sizes = jnp.asarray(case.sizes, jnp.int32)
  return _Operands(lhs, rhs, dy, sizes)


class _Functions(NamedTuple):
  """Ours and the references, jitted, all with f32 results."""

  gmm: Callable[..., jax.Array]
  ragged_dot: Callable[..., jax.Array]
  dense: Callable[..., jax.Array]
  tgmm: Callable[..., jax.Array]
  ragged_dot_general: Callable[..., jax.Array]
  gmm_grad: Callable[..., tuple[jax.Array, jax.Array]]
  ragged_dot_grad: Callable[..., tuple[jax.Array, jax.Array]]
  group_dots: Callable[..., jax.Array]
  group_dots_t: Callable[..., jax.Array]
  window_schedule: Callable[..., jax.Array]
  window_schedule_t: Callable[..., jax.Array]
  output_alone: Callable[..., jax.Array]


def _group_dots(sizes: Sequence[int]):
  """gmm and tgmm as one dot per group, the sizes fixed at trace time."""
  f32 = jnp.float32
  ends = np.cumsum(sizes)
  rows = [slice(int(e - s), int(e)) for s, e in zip(sizes, ends, strict=True)]

  def gmm(a, b):
    return jnp.concatenate(
      [
        jnp.dot(a[r], b[g], preferred_element_type=f32)
        for g, r in enumerate(rows)
        if r.stop > r.start
      ]
    )

  def tgmm(x, y):
    return jnp.stack(
      [jnp.dot(x[:, r], y[r], preferred_element_type=f32) for r in rows]
    )

  return jax.jit(gmm), jax.jit(tgmm)


class _Window(NamedTuple):
  start: int  # its first row
  rows: int
  lo: int  # the rows it contributes, [lo, hi)
  hi: int


def _windows(sizes: Sequence[int], m: int) -> list[list[_Window]]:
  """Per group, the windows that the CPU schedule computes for it (read from
  the kernel's own metadata, ``windows.group_windows``): whole chunks, then a
  tail window, moved back from the end of the array where it would run
  past it. Checks that each group's windows hold exactly its rows."""
  plan = windows.schedule(m)
  num = len(sizes)
  where = windows.group_windows(
    jnp.asarray(sizes, jnp.int32), jnp.int32(0), num, m, plan
  )
  # One tuple of plain ints per group, in Group's field order.
  per_group = zip(*(np.asarray(f).tolist() for f in where), strict=True)
  groups = []
  for g, (lo, hi, chunks, first, tail, start) in enumerate(per_group):
    group = [
      _Window(s, plan.chunk, s, s + plan.chunk)
      for s in range(lo, lo + chunks * plan.chunk, plan.chunk)
    ]
    if tail < len(plan.tails):
      group.append(_Window(start, plan.tails[tail], first, hi))
    covered = [r for w in group for r in range(w.lo, w.hi)]
    assert covered == list(range(lo, hi)), (sizes, g, group)
    assert all(
      0 <= w.start <= w.lo <= w.hi <= w.start + w.rows <= m for w in group
    )
    groups.append(group)
  return groups


def _window_schedule(sizes: Sequence[int], m: int):
  """gmm and tgmm as the CPU schedule with the sizes fixed at trace time:
  per group, a dot per whole chunk and one over its tail window (tgmm's
  window rows outside the group zeroed, as the kernel does), each stored
  once; XLA:CPU copies each window, as the kernel does."""
  f32 = jnp.float32
  groups = _windows(sizes, m)

  def gmm(a, b):
    out = []
    for g, group in enumerate(groups):
      for w in group:
        x = a[w.start : w.start + w.rows]
        y = jnp.dot(x, b[g], preferred_element_type=f32)
        out.append(y[w.lo - w.start : w.hi - w.start])
    return jnp.concatenate(out)

  def tgmm(x, y):
    out = []
    for group in groups:
      total = jnp.zeros((x.shape[0], y.shape[1]), f32)
      for w in group:
        rows = np.arange(w.start, w.start + w.rows)
        mine = (rows >= w.lo) & (rows < w.hi)
        xs = jnp.where(mine[None], x[:, w.start : w.start + w.rows], 0)
        ys = jnp.where(mine[:, None], y[w.start : w.start + w.rows], 0)
        total += jnp.dot(xs, ys, preferred_element_type=f32)
      out.append(total)
    return jnp.stack(out)

  return jax.jit(gmm), jax.jit(tgmm)


def _output_alone(groups: int):
  """The dense ``x @ y`` stored into each of ``groups`` slots of an f32
  output that starts as NaN (as the CPU fallback starts a kernel's
  outputs), one slot per step of a loop over ``count`` (traced, so that XLA
  cannot unroll it and drop the fill)."""

  def output_alone(x, y, count):
    product = jnp.dot(x, y, preferred_element_type=jnp.float32)
    filled = jnp.full((groups, *product.shape), jnp.nan, jnp.float32)

    def store(g, out):
      return lax.dynamic_update_index_in_dim(out, product, g, 0)

    return lax.fori_loop(0, count, store, filled)

  return jax.jit(output_alone)


def _functions(
  dy: jax.Array, sizes: Sequence[int], tiling: gm.Tiling | None
) -> _Functions:
  m = dy.shape[0]
  f32 = jnp.float32

  def gmm(a, b, s):
    return gm.gmm(a, b, s, preferred_element_type=f32, tiling=tiling)

  def ragged_dot(a, b, s):
    return lax.ragged_dot(a, b, s, preferred_element_type=f32)

  ragged_contract = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
  )

  def loss_grad(matmul):
    def f(a, b, s):
      return jnp.sum(matmul(a, b, s).astype(f32) * dy.astype(f32))

    return jax.jit(jax.grad(f, argnums=(0, 1)))

  group_dots, group_dots_t = _group_dots(sizes)
  window_schedule, window_schedule_t = _window_schedule(sizes, m)
  return _Functions(
    gmm=jax.jit(gmm),
    ragged_dot=jax.jit(ragged_dot),
    dense=jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=f32)),
    tgmm=jax.jit(
      lambda x, y, s: gm.tgmm(
        x, y, s, preferred_element_type=f32, tiling=tiling
      )
    ),
    ragged_dot_general=jax.jit(
      lambda x, y, s: lax.ragged_dot_general(
        x, y, s, ragged_contract, preferred_element_type=f32
      )
    ),
    gmm_grad=loss_grad(gmm),
    ragged_dot_grad=loss_grad(ragged_dot),
    group_dots=group_dots,
    group_dots_t=group_dots_t,
    window_schedule=window_schedule,
    window_schedule_t=window_schedule_t,
    output_alone=_output_alone(len(sizes)),
  )


def _check_answers(fns: _Functions, ops: _Operands) -> None:
  """Same answers before timing anything."""
  lhs, rhs, dy, sizes = ops
  np.testing.assert_allclose(
    fns.gmm(lhs, rhs, sizes),
    fns.ragged_dot(lhs, rhs, sizes),
    rtol=2e-2,
    atol=2e-2,
  )
  np.testing.assert_allclose(
    fns.tgmm(lhs.T, dy, sizes),
    fns.ragged_dot_general(lhs, dy, sizes),
    rtol=2e-2,
    atol=2e-2 * np.sqrt(lhs.shape[0]),
  )
  # The per-group dots and window schedule references compute the same rows.
  for reference in (fns.group_dots, fns.window_schedule):
    np.testing.assert_allclose(
      reference(lhs, rhs),
      fns.ragged_dot(lhs, rhs, sizes)[: int(sizes.sum())],
      rtol=2e-2,
      atol=2e-2,
    )
  np.testing.assert_allclose(
    fns.window_schedule_t(lhs.T, dy),
    fns.ragged_dot_general(lhs, dy, sizes),
    rtol=2e-2,
    atol=2e-2 * np.sqrt(lhs.shape[0]),
  )
  # Every slot of the output-alone reference holds the dense product (no
  # NaN left from the fill).
  groups = sizes.shape[0]
  dense_t = fns.dense(lhs.T, dy)
  np.testing.assert_allclose(
    fns.output_alone(lhs.T, dy, jnp.int32(groups)),
    jnp.broadcast_to(dense_t, (groups, *dense_t.shape)),
    rtol=1e-5,
    atol=1e-5 * np.sqrt(lhs.shape[0]),
  )


def _with_dense(name: str, ours, dense) -> dict[str, Callable[[], jax.Array]]:
  """A timing group of ``ours`` and its dense reference alone (see
  ``_vs_dense``)."""
  return {name: ours, f"dense vs {name}": dense}


def _vs_dense(times: dict[str, list[float]], name: str) -> float:
  """``name`` / its dense reference timed in its ``_with_dense`` group,
  paired."""
  return paired_ratio(times[name], times[f"dense vs {name}"])


def _time(
  fns: _Functions, ops: _Operands, rounds: int
) -> dict[str, list[float]]:
  """Seconds per call in each round, by name. Each comparison is timed
  interleaved with its own references only: XLA's ragged dots (several
  times slower, with large temporaries) and the backward passes (tens of
  MB of temporaries) get groups of their own, so that they do not evict
  the operands of what runs after them in a round."""
  lhs, rhs, dy, sizes = ops
  rhs0, lhs_t = rhs[0], lhs.T
  slots = jnp.int32(sizes.shape[0])
  groups = [
    {
      "gmm": lambda: fns.gmm(lhs, rhs, sizes),
      "dense": lambda: fns.dense(lhs, rhs0),
      "group_dots": lambda: fns.group_dots(lhs, rhs),
    },
    _with_dense(
      "window_schedule",
      lambda: fns.window_schedule(lhs, rhs),
      lambda: fns.dense(lhs, rhs0),
    ),
    {
      "gmm vs ragged_dot": lambda: fns.gmm(lhs, rhs, sizes),
      "ragged_dot": lambda: fns.ragged_dot(lhs, rhs, sizes),
    },
    {
      "tgmm": lambda: fns.tgmm(lhs_t, dy, sizes),
      "dense_t": lambda: fns.dense(lhs_t, dy),
      "group_dots_t": lambda: fns.group_dots_t(lhs_t, dy),
    },
    _with_dense(
      "window_schedule_t",
      lambda: fns.window_schedule_t(lhs_t, dy),
      lambda: fns.dense(lhs_t, dy),
    ),
    _with_dense(
      "output_alone",
      lambda: fns.output_alone(lhs_t, dy, slots),
      lambda: fns.dense(lhs_t, dy),
    ),
    {
      "tgmm vs ragged_dot_general": lambda: fns.tgmm(lhs_t, dy, sizes),
      "ragged_dot_general": lambda: fns.ragged_dot_general(lhs, dy, sizes),
    },
    {
      "gmm fwd+bwd": lambda: fns.gmm_grad(lhs, rhs, sizes),
      "ragged_dot fwd+bwd": lambda: fns.ragged_dot_grad(lhs, rhs, sizes),
    },
  ]
  t: dict[str, list[float]] = {}
  for group in groups:
    t |= time_rounds(group, rounds)
  return t


def _schedule(case: Case, tiling: gm.Tiling | None) -> str:
  if tiling is None:
    tiling = gm.default_tiling(case.m, case.k, case.n)
  if tiling is None:
    return "chunks and a tail window per group"
  return f"tiling {tiling}"


def run_case(
  case: Case, rounds: int, tiling: gm.Tiling | None = None
) -> dict[str, float]:
  """Ratios of one case; ``tiling`` as for gmm (None: the default)."""
  ops = _operands(case)
  fns = _functions(ops.dy, [int(s) for s in ops.sizes], tiling)
  _check_answers(fns, ops)
  times = _time(fns, ops, rounds)
  t = {name: statistics.median(ts) for name, ts in times.items()}
  return {
    "schedule": _schedule(case, tiling),
    "gmm_ms": t["gmm"] * 1e3,
    "gmm/ragged_dot": t["gmm vs ragged_dot"] / t["ragged_dot"],
    "gmm/dense": t["gmm"] / t["dense"],
    "gmm/dense paired": paired_ratio(times["gmm"], times["dense"]),
    "tgmm/ragged_dot_general": t["tgmm vs ragged_dot_general"]
    / t["ragged_dot_general"],
    "tgmm/dense": t["tgmm"] / t["dense_t"],
    "tgmm/dense paired": paired_ratio(times["tgmm"], times["dense_t"]),
    "gmm/group_dots": t["gmm"] / t["group_dots"],
    "tgmm/group_dots": t["tgmm"] / t["group_dots_t"],
    "window_schedule/dense": _vs_dense(times, "window_schedule"),
    "window_schedule_t/dense": _vs_dense(times, "window_schedule_t"),
    "output_alone/dense": _vs_dense(times, "output_alone"),
    "grad/ragged_dot_grad": t["gmm fwd+bwd"] / t["ragged_dot fwd+bwd"],
  }


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="mpmd bench grouped_matmul", description=__doc__.split("\n")[0]
  )
  parser.add_argument(
    "--quick", action="store_true", help="small shapes (seconds on 2 cores)"
  )
  parser.add_argument(
    "--rounds", type=int, default=None, help="timed rounds per function"
  )
  parser.add_argument(
    "--tiling",
    type=lambda text: tuple(int(t) for t in text.split(",")),
    default=None,
    help="tm,tk,tn: run the tiled kernel (default: the platform's schedule)",
  )
  args = parser.parse_args(argv)
  cases = QUICK_CASES if args.quick else FULL_CASES
  # Few-hundred-row dots move from round to round on 2 cores
  # (benchmarks/RESULTS.md).
  rounds = args.rounds or (3 if args.quick else 21)
  print(
    f"grouped_matmul on the {jax.default_backend()} backend "
    f"({'quick' if args.quick else 'full'}, {rounds} rounds, medians); "
    "ratios are ours / reference, < 1 is faster"
  )
  for i, case in enumerate(cases, 1):
    print(
      f"[{i}/{len(cases)}] {case.name}: m={case.m} k={case.k} n={case.n} "
      f"groups={case.groups} {case.dtype}"
      + (f" sizes={list(case.sizes)}" if case.sizes else "")
      + " ...",
      flush=True,
    )
    r = run_case(case, rounds, args.tiling)
    print(
      f"    {r['schedule']}  gmm {r['gmm_ms']:.2f} ms  "
      f"gmm/ragged_dot {r['gmm/ragged_dot']:.2f}x (target <= 0.3)  "
      f"gmm/dense {r['gmm/dense']:.2f}x "
      f"(paired {r['gmm/dense paired']:.2f}x, target <= 1.5)\n"
      f"    tgmm/dense {r['tgmm/dense']:.2f}x "
      f"(paired {r['tgmm/dense paired']:.2f}x, target <= 1.5)  "
      f"vs per-group dots: gmm {r['gmm/group_dots']:.2f}x  "
      f"tgmm {r['tgmm/group_dots']:.2f}x\n    "
      "the window schedule in static XLA / dense (paired): "
      f"gmm {r['window_schedule/dense']:.2f}x "
      f"tgmm {r['window_schedule_t/dense']:.2f}x\n    "
      "tgmm's output alone / dense (paired): "
      f"{r['output_alone/dense']:.2f}x (the dense dot stored into each "
      "group's slot of a filled output)\n    "
      f"tgmm/ragged_dot_general {r['tgmm/ragged_dot_general']:.2f}x  "
      f"fwd+bwd vs ragged_dot {r['grad/ragged_dot_grad']:.2f}x",
      flush=True,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
