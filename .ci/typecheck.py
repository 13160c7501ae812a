"""Type-checks the library with pyrefly, as the installed package lays it out.

The source tree is not importable as `mpmd`: pyproject.toml's
[tool.setuptools.package-dir] maps `mpmd._lowering` to lowering/,
`mpmd.kernels` to kernels/ and so on. This script builds that layout in a
temporary directory out of symlinks (one per file or folder, nothing copied),
then runs `pyrefly check` over it with the configuration in pyproject.toml's
[tool.pyrefly] and the known errors of .ci/pyrefly-baseline.json. Errors are
reported against the repository's own paths.

  python .ci/typecheck.py            # the interpreter running it is the one
                                     # whose jax pyrefly reads
  python .ci/typecheck.py --any      # also count the library's uses of `Any`

Other arguments go to `pyrefly check`. Exits with pyrefly's status: non-zero
when there is an error that the baseline does not list.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Errors not fixed yet, each in a module under rework: pyrefly lets these
# through (matched by file, kind, column and message, not line) and fails on
# any other. `--update-baseline` rewrites it from a run (run it under each
# supported jax and keep the union); fixing one makes its entry stale.
BASELINE = ROOT / ".ci" / "pyrefly-baseline.json"


def package_dirs() -> dict[str, Path]:
  """Each package's source folder, from pyproject.toml."""
  with open(ROOT / "pyproject.toml", "rb") as f:
    config = tomllib.load(f)
  mapping = config["tool"]["setuptools"]["package-dir"]
  return {package: ROOT / folder for package, folder in mapping.items()}


def build_tree(dest: Path, packages: dict[str, Path]) -> list[Path]:
  """Lays the packages out under `dest` as they are installed.

  A package whose subpackages all live inside its own folder is one symlink;
  one with a subpackage elsewhere (`mpmd`, whose `mpmd._lowering` is
  lowering/) is a real folder of symlinks, one per entry, plus one per
  such subpackage. Returns the top-level package folders.
  """
  for package in sorted(packages, key=lambda p: p.count(".")):
    source = packages[package]
    target = dest.joinpath(*package.split("."))
    if target.exists():  # inside a folder linked as a whole
      if target.resolve() != source.resolve():
        raise SystemExit(
          f"typecheck: {package} maps to {source}, but its parent's folder"
          f" has {target.resolve()}"
        )
      continue
    elsewhere = any(
      sub.startswith(package + ".")
      and not packages[sub].resolve().is_relative_to(source.resolve())
      for sub in packages
    )
    if not elsewhere:
      target.symlink_to(source, target_is_directory=True)
      continue
    target.mkdir(parents=True)
    for entry in source.iterdir():
      if entry.name != "__pycache__":
        (target / entry.name).symlink_to(entry)
  return [dest / p for p in packages if "." not in p]


def count_any(packages: dict[str, Path]) -> int:
  """How many times the library's code names `Any` (imports aside)."""
  seen: set[Path] = set()
  total = 0
  for source in packages.values():
    for path in sorted(source.rglob("*.py")):
      path = path.resolve()
      if path in seen:
        continue
      seen.add(path)
      tree = ast.parse(path.read_text(), str(path))
      total += sum(
        (isinstance(node, ast.Name) and node.id == "Any")
        or (isinstance(node, ast.Attribute) and node.attr == "Any")
        for node in ast.walk(tree)
      )
  return total


def pyrefly() -> str:
  """The pyrefly next to this interpreter, else the one on the PATH."""
  local = Path(sys.executable).parent / "pyrefly"
  found = str(local) if local.exists() else shutil.which("pyrefly")
  if found is None:
    raise SystemExit(
      "typecheck: pyrefly is not installed; pip install -e '.[test]'"
    )
  return found


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--any", action="store_true", help="also count `Any` in the library"
  )
  # Anything else goes to `pyrefly check` (e.g. --count-errors=0).
  args, pyrefly_args = parser.parse_known_args()
  packages = package_dirs()
  if args.any:
    print(f"typecheck: `Any` named {count_any(packages)} times")
  with tempfile.TemporaryDirectory(prefix="mpmd-typecheck-") as tmp:
    tree = Path(tmp)
    tops = build_tree(tree, packages)
    # pyrefly takes a config only for files below it.
    (tree / "pyproject.toml").symlink_to(ROOT / "pyproject.toml")
    command = [
      pyrefly(),
      "check",
      "--config",
      str(tree / "pyproject.toml"),
      "--python-interpreter-path",
      sys.executable,
      "--search-path",
      str(tree),
      "--baseline",
      str(BASELINE),
      "--relative-to=",  # absolute paths, which _unshadow maps back
      *(top.name for top in tops),
      *pyrefly_args,
    ]
    # Paths in the baseline are relative to the tree: mpmd/_lowering/x.py.
    result = subprocess.run(
      command, cwd=tree, capture_output=True, text=True, check=False
    )
  # Paths as the repository has them, not as the temporary tree does.
  prefix = str(tree) + os.sep
  for stream, text in (
    (sys.stdout, result.stdout),
    (sys.stderr, result.stderr),
  ):
    stream.write(_unshadow(text, prefix, packages))
  return result.returncode


def _unshadow(text: str, prefix: str, packages: dict[str, Path]) -> str:
  # Longest package first: mpmd/_lowering/x.py is lowering/x.py, not mpmd/...
  for package in sorted(packages, key=lambda p: -p.count(".")):
    shadow = prefix + package.replace(".", os.sep) + os.sep
    real = os.path.relpath(packages[package], ROOT) + os.sep
    text = text.replace(shadow, real)
  return text.replace(prefix, "")


if __name__ == "__main__":
  sys.exit(main())
