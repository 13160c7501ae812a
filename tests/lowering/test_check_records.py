"""The checker's synchronisation records made from per-equation templates
(``records.record_of``) equal the ones read from Pallas' operand pytrees
(``record_types()[primitive].of``), and the windows a launch finds by the
id of remembered views are the ones it would cut."""

import dataclasses

import jax
import numpy as np
import pytest
from checked_ring import ring_launch

from mpmd._jax import tree_util
from mpmd._lowering.check import machine, records


def _leaves(tree):
  leaves, structure = tree_util.tree_flatten(tree)
  return structure, [(type(x), np.asarray(x).tolist()) for x in leaves]


def _assert_same(got, want):
  assert type(got) is type(want)
  for field in dataclasses.fields(want):
    a, b = getattr(got, field.name), getattr(want, field.name)
    if isinstance(b, records.RefOperand):
      assert isinstance(a, records.RefOperand), field.name
      assert a.ref is b.ref, field.name
      a, b = tuple(a.transforms), tuple(b.transforms)
    assert _leaves(a) == _leaves(b), field.name


def test_templates_make_the_records_pallas_operands_read(monkeypatch):
  made = []
  record_of = records.record_of

  def checked(eqn, values, memo):
    got = record_of(eqn, values, memo)
    want = records.record_types()[eqn.primitive].of(eqn, values)
    _assert_same(got, want)
    made.append(type(got))
    return got

  monkeypatch.setattr(records, "record_of", checked)
  launch = ring_launch("random:3")
  first = np.asarray(launch())
  second = np.asarray(launch())  # from the templates of the first
  np.testing.assert_array_equal(first, second)
  kinds = set(made)
  assert {records.DmaStart, records.DmaWait} <= kinds, kinds


def test_remembered_views_resolve_to_the_windows_they_cut(monkeypatch):
  seen = {"remembered": 0}
  resolve = machine.Machine.resolve

  def checked(self, ref, transforms, describe):
    got = resolve(self, ref, transforms, describe)
    base, views = ref, transforms
    if isinstance(ref, records.RefOperand):
      base, views = ref.ref, (*ref.transforms, *transforms)
    if type(views) is records.Views or (
      isinstance(ref, records.RefOperand)
      and type(ref.transforms) is records.Views
    ):
      seen["remembered"] += 1
    want = self._narrow(base, tuple(views), describe)
    assert got.buffer is want.buffer
    np.testing.assert_array_equal(got.ids, want.ids)
    assert got.slab == want.slab
    return got

  monkeypatch.setattr(machine.Machine, "resolve", checked)
  launch = ring_launch("random:5")
  for _ in range(2):  # the second launch finds the first's windows
    jax.block_until_ready(launch())
  assert seen["remembered"] > 0


@pytest.mark.parametrize(
  "values, key",
  [
    ([np.int32(3), 4, None], True),
    ([np.asarray(2, np.int8), True], True),
    ([np.arange(3, dtype=np.int32)], None),  # an index array
    ([np.float32(1.0)], None),
  ],
)
def test_scalar_key_takes_integer_scalars_only(values, key):
  got = records.scalar_key(values)
  if key is None:
    assert got is None
  else:
    assert got is not None and len(got) == len(values)


def test_scalar_key_tells_types_and_dtypes_apart():
  a = records.scalar_key([np.int32(1)])
  assert a == records.scalar_key([np.int32(1)])
  assert a != records.scalar_key([np.int64(1)])
  assert a != records.scalar_key([np.asarray(1, np.int32)])
  assert a != records.scalar_key([1])
