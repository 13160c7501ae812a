"""Dumps the lowered TPU / CUDA (and CPU) modules of every shipped demo.

A refactoring that must leave kernel lowerings unchanged is checked by
dumping before and after and comparing the two folders:

  python benchmarks/lowered_texts.py dump /tmp/before
  ... change the code ...
  python benchmarks/lowered_texts.py dump /tmp/after
  python benchmarks/lowered_texts.py compare /tmp/before /tmp/after

Demos are the registered ones (``mpmd lower NAME``) and every
``examples/*.py`` that defines ``demo()``. Each is lowered for each platform
it names, one file per (demo, platform). Source locations are dropped (they
name lines, which move), but Mosaic GPU kernels keep the file and line of
their kernel function in their serialized form: dump both from the same
checkout, with the kernels' files unchanged. On jax 0.10.2 the CPU
fallback's modules of some kernels (the ring collectives, gmm) are not the
same from run to run (the order of a loop's constants): dump the base a few
times, and compare with each. Not a test: the text changes with every JAX
release, so compare dumps made with the same jax.
"""

import argparse
import difflib
import re
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

from mpmd import cli, demos  # noqa: E402

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# MLIR location attributes and aliases: they name source lines.
_LOCATION = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)|^#loc.*$", re.M)
# Mosaic's serialized source locations, inside a TPU custom call's config.
_DEBUG_LOCATIONS = re.compile(r"\\22debug_locations\\22: \\22[^\\]*\\22")


def _normal(text: str) -> str:
  """``text`` without source locations."""
  return _DEBUG_LOCATIONS.sub("debug_locations", _LOCATION.sub("", text))


def _demos():
  yield from sorted(demos.registered().items())
  for path in sorted(_EXAMPLES.glob("*.py")):
    if "def demo()" in path.read_text():
      yield (
        f"examples.{path.stem}",
        lambda path=path: cli._load_demo_file(str(path)),
      )


def dump(folder: Path, platforms: tuple[str, ...]) -> int:
  folder.mkdir(parents=True, exist_ok=True)
  for name, make in _demos():
    demo = make()
    for target in demo.platforms:
      if target not in platforms:
        continue
      try:
        text = _normal(cli._lowered_text(demo, target))
      except Exception as e:  # noqa: BLE001 (a failure is itself a result)
        text = f"FAILED: {type(e).__name__}: {e}"
      (folder / f"{name}.{target}.mlir").write_text(text)
      print(f"{name:40s} {target:5s} {len(text):8d} characters")
  return 0


def compare(before: Path, after: Path) -> int:
  names = sorted({p.name for p in before.glob("*.mlir")})
  names += sorted({p.name for p in after.glob("*.mlir")} - set(names))
  changed = 0
  for name in names:
    a, b = before / name, after / name
    if not a.exists() or not b.exists():
      print(f"{name}: only in {'after' if b.exists() else 'before'}")
      changed += 1
      continue
    text_a, text_b = _normal(a.read_text()), _normal(b.read_text())
    if text_a != text_b:
      changed += 1
      diff = difflib.unified_diff(
        text_a.splitlines(), text_b.splitlines(), lineterm=""
      )
      print(f"{name}: differs")
      print("\n".join(line[:160] for line in list(diff)[:40]))
  print(f"{len(names) - changed} of {len(names)} modules unchanged")
  return 1 if changed else 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  d = sub.add_parser("dump")
  d.add_argument("folder", type=Path)
  d.add_argument("--platforms", default="tpu,cuda,cpu")
  c = sub.add_parser("compare")
  c.add_argument("before", type=Path)
  c.add_argument("after", type=Path)
  args = parser.parse_args(argv)
  if args.command == "dump":
    return dump(args.folder, tuple(args.platforms.split(",")))
  return compare(args.before, args.after)


if __name__ == "__main__":
  sys.exit(main())
