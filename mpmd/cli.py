"""The ``mpmd`` command: check the install, lower kernels, benchmark them.

mpmd check                               versions, what lowers, what runs
mpmd lower NAME|FILE.py --platform tpu   print (or -o write) the module
mpmd bench NAME [args...]                benchmarks/NAME.py, as ratios
"""

import argparse
import importlib.util
import os
import platform
import sys
import textwrap
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import jax
import jaxlib

import mpmd
from mpmd import demos, registry, targets

# Shard_map demos need several devices: main() asks for them before check
# or lower starts a backend (importing this module changes nothing). A
# benchmark asks for the devices it needs itself: with 8 CPU devices XLA's
# CPU client runs 8 intra-op threads (2 with one or two devices on 2
# cores), and one device's small dots, split across them, ran slower (gmm
# and XLA's per-group dots 1.2-1.3x on jax 0.12, in four pairs of runs).
_NUM_CPU_DEVICES = 8


def _check(args) -> int:
  del args
  print(f"jax-mpmd {mpmd.__version__}")
  print(f"python   {platform.python_version()}")
  print(f"jax      {jax.__version__}   jaxlib {jaxlib.__version__}")
  print(f"backend  {jax.default_backend()} ({len(jax.devices())} devices)")
  rows, ok = [], True
  for demo_name in ("quickstart", "gpu_quickstart"):
    demo = demos.registered()[demo_name]()
    for target in demo.platforms:
      start = time.perf_counter()
      try:
        if target == "cpu":
          status = "runs, " + registry.check(demo)
        else:
          text = _lowered_text(demo, target)
          marker = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu"}[target]
          status = "lowers" if marker in text else f"no {marker} in module"
      except Exception as e:  # noqa: BLE001 (report, do not crash)
        status = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0]}"
        ok = ok and target != "cpu"
      rows.append((demo_name, target, status, time.perf_counter() - start))
  width = max(len(r[0]) for r in rows)
  print(f"\n{'kernel':<{width}}  platform  {'seconds':>7}  status")
  for name, target, status, seconds in rows:
    print(f"{name:<{width}}  {target:<8}  {seconds:7.2f}  {status}")
  return 0 if ok else 1


def _lowered_text(demo, target: str) -> str:
  # For TPU, trace what a TPU would run: kernels pick their TPU schedule and
  # tiles inside tpu_target (on this host they would pick the CPU's).
  building = targets.tpu_target() if target == "tpu" else nullcontext()
  with building:
    traced = jax.jit(demo.fn).trace(*demo.args)
    return traced.lower(lowering_platforms=(target,)).as_text()


_FILE_HELP = """\
NAME is a registered kernel:
{names}

FILE.py is a Python file that defines demo(), taking no arguments and
returning an mpmd.registry.Demo(fn, args, platforms): mpmd lower traces
jax.jit(fn)(*args) and lowers it for --platform. examples/*.py have one:

  def demo() -> mpmd.registry.Demo:
    x = jnp.ones((8, 256), jnp.float32)
    return mpmd.registry.Demo(axpy, (x, x), ("tpu", "cpu"))
"""


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  line = text.splitlines()[0] if text else ""
  return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _load_demo(name: str) -> registry.Demo:
  """The demo ``mpmd lower NAME`` lowers; a ``SystemExit`` with one line
  saying why when there is none."""
  if name.endswith(".py"):
    return _load_demo_file(name)
  known = demos.registered()
  if name not in known:
    raise SystemExit(
      f"mpmd lower: unknown kernel {name!r}; known: {', '.join(sorted(known))}"
      " (or pass an examples/*.py file)"
    )
  return known[name]()


def _load_demo_file(name: str) -> registry.Demo:
  path = Path(name)
  if not path.is_file():
    raise SystemExit(f"mpmd lower: no such file {name}")
  spec = importlib.util.spec_from_file_location(path.stem, path)
  if spec is None or spec.loader is None:
    raise SystemExit(f"mpmd lower: {name} is not a Python file")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise SystemExit(
      f"mpmd lower: {name}:{e.lineno}: SyntaxError: {e.msg}"
    ) from None
  except Exception as e:  # noqa: BLE001 (the user's file: say what and where)
    raise SystemExit(
      f"mpmd lower: {name} failed to import: {_first_line(e)}"
    ) from None
  make = getattr(module, "demo", None)
  if not callable(make):
    raise SystemExit(
      f"mpmd lower: {name} defines no demo() returning an mpmd.registry.Demo "
      "(see mpmd lower --help)"
    )
  try:
    demo = make()
  except Exception as e:  # noqa: BLE001 (the user's demo(): say what)
    raise SystemExit(
      f"mpmd lower: {name}: demo() raised {_first_line(e)}"
    ) from None
  if not isinstance(demo, registry.Demo):
    raise SystemExit(
      f"mpmd lower: {name}: demo() should return an mpmd.registry.Demo, "
      f"got {type(demo).__name__}"
    )
  return demo


def _lower(args) -> int:
  demo = _load_demo(args.name)
  if args.output:
    _check_writable(args.output)
  try:
    text = _lowered_text(demo, args.platform)
  except Exception as e:  # noqa: BLE001 (one line: why it does not lower)
    meant = ", ".join(demo.platforms)
    raise SystemExit(
      f"mpmd lower: {args.name} does not lower for {args.platform} (it is "
      f"meant for {meant}): {_first_line(e)}"
    ) from None
  if args.output:
    try:
      Path(args.output).write_text(text)
    except OSError as e:
      raise SystemExit(_unwritable(args.output, e)) from None
    print(f"wrote {len(text)} characters to {args.output}")
  else:
    print(text)
  return 0


def _check_writable(output: str) -> None:
  """Fails before lowering when ``-o`` cannot be written."""
  path = Path(output)
  if path.is_dir():
    raise SystemExit(f"mpmd lower: cannot write {output}: it is a directory")
  parent = path.parent
  if not parent.is_dir():
    raise SystemExit(
      f"mpmd lower: cannot write {output}: no directory {parent}"
    )
  target = path if path.exists() else parent
  if not os.access(target, os.W_OK):
    raise SystemExit(f"mpmd lower: cannot write {output}: permission denied")


def _unwritable(output: str, error: OSError) -> str:
  return f"mpmd lower: cannot write {output}: {error.strerror or error}"


def _bench(args) -> int:
  root = Path(__file__).resolve().parent.parent / "benchmarks"
  path = root / f"{args.name}.py"
  if not path.exists():
    names = sorted(
      p.stem for p in root.glob("*.py") if not p.stem.startswith("_")
    )
    raise SystemExit(
      f"mpmd bench: no benchmark {args.name!r} in {root} (benchmarks live "
      f"in a source checkout); known: {', '.join(names) or 'none'}"
    )
  # Benchmarks share helpers (benchmarks/_timing.py) as sibling modules.
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))
  spec = importlib.util.spec_from_file_location(f"bench_{args.name}", path)
  # A path ending in .py always has a spec and a loader.
  assert spec is not None and spec.loader is not None, path
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main(args.rest) or 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="mpmd",
    description=__doc__,
    formatter_class=argparse.RawTextHelpFormatter,
  )
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("check", help="versions, which platforms lower and run")
  lower = sub.add_parser(
    "lower",
    help="print the lowered module of a kernel",
    description="Prints (or -o writes) the lowered module of a kernel.",
    epilog=_FILE_HELP.format(
      names=textwrap.fill(", ".join(sorted(demos.registered())), 76)
    ),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  lower.add_argument(
    "name",
    metavar="NAME|FILE.py",
    help="a registered kernel, or a file that defines demo() (see below)",
  )
  lower.add_argument(
    "--platform",
    choices=("tpu", "cuda", "cpu"),
    default="tpu",
    help="the platform to lower for (default: tpu)",
  )
  lower.add_argument(
    "-o", "--output", metavar="PATH", help="write the module to this file"
  )
  bench = sub.add_parser("bench", help="run benchmarks/NAME.py")
  bench.add_argument("name")
  bench.add_argument("rest", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  try:
    if args.command != "bench":
      jax.config.update("jax_num_cpu_devices", _NUM_CPU_DEVICES)
    return {"check": _check, "lower": _lower, "bench": _bench}[args.command](
      args
    )
  except SystemExit:
    raise
  except Exception:  # noqa: BLE001 (a CLI prints, then fails)
    traceback.print_exc()
    return 1


if __name__ == "__main__":
  sys.exit(main())
