"""``mpmd lower``'s failures: one line on stderr, a non-zero exit, no
traceback (issue 36, item 9)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import mpmd
from mpmd import cli

# (a file's text, what the one line says)
BAD_FILES = {
  "syntax": ("def demo(:\n", r"example\.py:1: SyntaxError: "),
  "import": (
    "import no_such_module_here\n",
    r"example\.py failed to import: ModuleNotFoundError: "
    r"No module named 'no_such_module_here'",
  ),
  "no_demo": ("x = 1\n", r"example\.py defines no demo\(\) returning"),
  "not_callable": ("demo = 3\n", r"example\.py defines no demo\(\)"),
  "raises": (
    "def demo():\n  raise RuntimeError('no data\\nsecond line')\n",
    r"example\.py: demo\(\) raised RuntimeError: no data$",
  ),
  "wrong_type": (
    "def demo():\n  return (1, 2)\n",
    r"example\.py: demo\(\) should return an mpmd\.registry\.Demo, got tuple",
  ),
}


def _one_line(exit_info) -> str:
  message = exit_info.value.code
  assert isinstance(message, str), message
  assert "\n" not in message and "Traceback" not in message
  assert message.startswith("mpmd lower: ")
  return message


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_example_file_is_one_line(tmp_path, case):
  text, words = BAD_FILES[case]
  path = tmp_path / "example.py"
  path.write_text(text)
  with pytest.raises(SystemExit, match=words) as caught:
    cli.main(["lower", str(path)])
  _one_line(caught)


def test_a_missing_file_is_one_line(tmp_path):
  with pytest.raises(SystemExit, match="no such file") as caught:
    cli.main(["lower", str(tmp_path / "nowhere.py")])
  _one_line(caught)


@pytest.mark.parametrize(
  ("name", "platform", "words"),
  [
    (
      "gpu_quickstart",
      "tpu",
      r"gpu_quickstart does not lower for tpu \(it is meant for cuda, cpu\): "
      r"NotImplementedError: mpmd_map: TPU lowering needs TPU meshes",
    ),
    (
      "quickstart",
      "cuda",
      r"quickstart does not lower for cuda \(it is meant for tpu, cpu\): "
      r"NotImplementedError: mpmd_map: CUDA lowering needs Mosaic GPU meshes",
    ),
  ],
)
def test_a_kernel_for_another_platform_is_one_line(name, platform, words):
  with pytest.raises(SystemExit, match=words) as caught:
    cli.main(["lower", name, "--platform", platform])
  _one_line(caught)


def test_tpu_lowering_of_a_gpu_mesh_says_so():
  def copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  f = mpmd.mpmd_map(
    [(plgpu.Mesh(num_threads=1, thread_name="wg"), copy)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
  )
  x = jnp.ones((8, 128), jnp.float32)
  with pytest.raises(
    NotImplementedError,
    match=r"TPU lowering needs TPU meshes .*got \['Mesh \(gpu\)'\]",
  ):
    jax.jit(f).trace(x).lower(lowering_platforms=("tpu",))


@pytest.mark.parametrize(
  ("where", "words"),
  [
    ("missing/out.mlir", r"cannot write .*out\.mlir: no directory "),
    (".", r"cannot write .*: it is a directory"),
  ],
)
def test_an_unwritable_output_is_one_line_before_lowering(
  tmp_path, monkeypatch, where, words
):
  lowered = []
  monkeypatch.setattr(cli, "_lowered_text", lambda *a: lowered.append(a))
  with pytest.raises(SystemExit, match=words) as caught:
    cli.main(["lower", "quickstart", "-o", str(tmp_path / where)])
  _one_line(caught)
  assert not lowered  # it failed first, not after a long lowering


def test_a_failed_write_is_one_line(tmp_path, monkeypatch):
  def refuse(self, text):
    raise PermissionError(13, "Permission denied", str(self))

  monkeypatch.setattr(cli.Path, "write_text", refuse)
  out = tmp_path / "out.mlir"
  with pytest.raises(
    SystemExit, match=r"cannot write .*out\.mlir: Permission denied$"
  ) as caught:
    cli.main(["lower", "quickstart", "-o", str(out)])
  _one_line(caught)


def test_lower_help_documents_demo(capsys):
  with pytest.raises(SystemExit) as caught:
    cli.main(["lower", "--help"])
  assert caught.value.code == 0
  out = capsys.readouterr().out
  assert "NAME|FILE.py" in out
  assert "defines demo()" in out
  assert "mpmd.registry.Demo(fn, args, platforms)" in out
  assert "quickstart" in out  # the registered kernels are listed


def _mpmd(*args, cwd):
  return subprocess.run(
    [sys.executable, "-m", "mpmd.cli", *args],
    capture_output=True,
    text=True,
    cwd=cwd,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    timeout=300,
  )


def test_the_command_prints_one_line_to_stderr_and_exits_non_zero(tmp_path):
  """As a user sees it: the process itself (one case of each kind)."""
  (tmp_path / "example.py").write_text(
    textwrap.dedent("""\
      def demo():
        raise ValueError("bad shapes")
    """)
  )
  cases = [
    (["lower", "example.py"], "demo() raised ValueError: bad shapes"),
    (["lower", "gpu_quickstart", "--platform", "tpu"], "does not lower"),
    (["lower", "quickstart", "-o", "no/such/dir/x.mlir"], "cannot write"),
  ]
  for args, words in cases:
    result = _mpmd(*args, cwd=tmp_path)
    assert result.returncode != 0, args
    assert result.stdout == "", args
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
