"""The tree stays one a maintainer can read: modules and functions of a
size to hold in one's head."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_DIRS = ("mpmd", "primitives", "lowering", "kernels")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80  # of code: a docstring (with its example) aside

# Kernel bodies: one program's whole schedule, read top to bottom as the
# hardware runs it (splitting them would hide the order of its DMAs and
# waits).
KERNEL_BODIES = {
  ("kernels/collective_matmul/_all_gather.py", "_ag_body"),
  ("kernels/collective_matmul/_all_gather.py", "body"),
  ("kernels/collective_matmul/_reduce_scatter.py", "_rs_body"),
  ("kernels/collective_matmul/_reduce_scatter.py", "body"),
}


def _sources() -> dict[str, str]:
  return {
    str(p.relative_to(ROOT)): p.read_text()
    for d in LIBRARY_DIRS
    for p in sorted((ROOT / d).rglob("*.py"))
  }


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines of ``function``, its docstring not counted."""
  lines = function.end_lineno - function.lineno + 1
  first = function.body[0]
  if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
    if isinstance(first.value.value, str):
      lines -= first.end_lineno - first.lineno + 1
  return lines


def long_functions(sources: dict[str, str]) -> list[str]:
  found = []
  for path, text in sources.items():
    for node in ast.walk(ast.parse(text)):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      if (path, node.name) in KERNEL_BODIES:
        continue
      if (n := code_lines(node)) > MAX_FUNCTION_LINES:
        found.append(f"{path}:{node.lineno} {node.name}: {n} lines")
  return found


def test_no_module_over_600_lines():
  sources = _sources()
  assert len(sources) > 50
  long = {
    path: n
    for path, text in sources.items()
    if (n := len(text.splitlines())) > MAX_MODULE_LINES
  }
  assert long == {}


def test_no_function_over_80_lines_outside_kernel_bodies():
  assert long_functions(_sources()) == []


def test_kernel_bodies_exempted_exist():
  """The exemptions name functions that are there (a renamed body must
  not leave a stale entry that would exempt a new long function)."""
  sources = _sources()
  names = {
    (path, node.name)
    for path, text in sources.items()
    for node in ast.walk(ast.parse(text))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
  }
  assert KERNEL_BODIES <= names


@pytest.mark.parametrize(
  ("body", "expected"),
  [
    ('  """Doc.\n\n  More."""\n' + "  x = 1\n" * 80, 1),
    ('  """Doc."""\n' + "  x = 1\n" * 79, 0),
  ],
)
def test_the_size_check_counts_code_not_docstrings(body, expected):
  assert len(long_functions({"x.py": f"def f():\n{body}"})) == expected
