"""tests/suite_order.py: the workers' order (longest first, a module with costly set-up kept whole) and its costs
file."""
import json
from types import SimpleNamespace

import pytest

import suite_order


class Item:
    def __init__(self, nodeid):
        self.nodeid, self.marks = nodeid, []

    def add_marker(self, mark):
        self.marks.append(mark)


def test_units_longest_first_and_a_costly_module_whole():
    ids = ["tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1", "tests/d.py::new"]
    costs = {"tests/a.py::t1": {"total": 30.0, "setup": 6.0}, "tests/a.py::t2": {"total": 1.0, "setup": 0.0},
             "tests/b.py::t1": {"total": 2.0, "setup": 0.1}, "tests/b.py::t2": {"total": 50.0, "setup": 0.1},
             "tests/c.py::t1@g": {"total": 10.0, "setup": 0.0}}  # a recorded id with xdist's @group suffix
    items = [Item(i) for i in ids]
    costs = {k.split("@")[0]: v for k, v in costs.items()}
    out = suite_order.order(items, costs)
    # a.py spent 6 s setting up: one unit of 31 s, its tests in their order; b.py's tests go alone; d.py's unknown
    # test costs the median of the known ones (10)
    assert [i.nodeid for i in out] == ["tests/b.py::t2", "tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t1",
                                       "tests/d.py::new", "tests/b.py::t1"]
    assert [m.args for m in items[0].marks] == [("tests_a.py",)] == [m.args for m in items[1].marks]
    assert not items[2].marks and not items[5].marks
    plain = [Item(i) for i in ids]
    assert suite_order.order(plain, {}) == plain  # no costs: the collection order


def test_the_costs_file_round_trips_and_a_bad_one_is_named(tmp_path):
    rec = suite_order.Recorder()
    for nodeid, when, d in (("tests/a.py::t@g", "setup", 2.0), ("tests/a.py::t@g", "call", 3.0),
                            ("tests/b.py::u", "call", 0.5)):
        rec.add(SimpleNamespace(nodeid=nodeid, when=when, duration=d, failed=False))
    rec.write(tmp_path / "d.json")
    assert suite_order.load(tmp_path / "d.json") == {"tests/a.py::t": {"total": 5.0, "setup": 2.0},
                                                     "tests/b.py::u": {"total": 0.5, "setup": 0.0}}
    assert suite_order.load(tmp_path / "none.json") == {}
    (tmp_path / "bad.json").write_text(json.dumps({"tests/a.py::t": 3}))
    with pytest.raises(pytest.UsageError, match="bad.json: not a test-durations file"):
        suite_order.load(tmp_path / "bad.json")
