"""tests/suite_order.py: the workers' order (longest first, a module with costly set-up kept whole) and its costs
file."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

import suite_order


class Item:
    def __init__(self, nodeid, scope="function"):  # scope: the scope of the one fixture the test uses
        self.nodeid, self.marks = nodeid, []
        self._fixtureinfo = SimpleNamespace(name2fixturedefs={"f": [SimpleNamespace(scope=scope)]})

    def add_marker(self, mark):
        self.marks.append(mark)

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)


def test_units_longest_first_and_a_costly_module_whole():
    ids = ["tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1", "tests/d.py::new",
           "tests/e.py::t1", "tests/e.py::t2"]
    costs = {"tests/a.py::t1": {"total": 30.0, "setup": 6.0}, "tests/a.py::t2": {"total": 1.0, "setup": 0.0},
             "tests/b.py::t1": {"total": 2.0, "setup": 0.1}, "tests/b.py::t2": {"total": 50.0, "setup": 0.1},
             "tests/c.py::t1@g": {"total": 10.0, "setup": 0.0},  # a recorded id with xdist's @group suffix
             "tests/e.py::t1": {"total": 40.0, "setup": 9.0}, "tests/e.py::t2": {"total": 35.0, "setup": 0.0}}
    items = [Item(i, "module" if i.startswith("tests/a.py") else "session" if i == "tests/e.py::t1" else "function")
             for i in ids]
    costs = {k.split("@")[0]: v for k, v in costs.items()}
    out = suite_order.order(items, costs)
    # a.py spent 6 s setting up a module fixture: one unit of 31 s, its tests in their order; b.py's tests go alone;
    # d.py's unknown test costs the median of the known ones (30); e.py waited 9 s on a session fixture, which a
    # group would not build once: its tests stay apart
    assert [i.nodeid for i in out] == ["tests/b.py::t2", "tests/e.py::t1", "tests/e.py::t2", "tests/a.py::t1",
                                       "tests/a.py::t2", "tests/d.py::new", "tests/c.py::t1", "tests/b.py::t1"]
    assert [m.args for m in items[0].marks] == [("tests_a.py",)] == [m.args for m in items[1].marks]
    assert not items[2].marks and not items[5].marks and not items[6].marks
    plain = [Item(i) for i in ids]
    assert suite_order.order(plain, {}) == plain  # no costs: the collection order


def test_the_modules_that_wait_are_one_unit_ahead_of_the_longest():
    """Tests marked `waits` (whatever their module or cost) are one xdist group, taken first: they wait on one worker
    while the longest unit computes on the other."""
    ids = ["tests/a.py::t1", "tests/w.py::t1", "tests/b.py::t1", "tests/w.py::t2", "tests/v.py::t1"]
    costs = {"tests/a.py::t1": {"total": 90.0, "setup": 0.0}, "tests/b.py::t1": {"total": 5.0, "setup": 0.0},
             "tests/w.py::t1": {"total": 2.0, "setup": 0.0}, "tests/w.py::t2": {"total": 3.0, "setup": 0.0},
             "tests/v.py::t1": {"total": 1.0, "setup": 0.0}}
    items = [Item(i) for i in ids]
    for it in items:
        if it.nodeid.split("::")[0] in ("tests/w.py", "tests/v.py"):
            it.add_marker(SimpleNamespace(name=suite_order.WAITS, args=()))
    out = suite_order.order(items, costs)
    assert [i.nodeid for i in out] == ["tests/w.py::t1", "tests/w.py::t2", "tests/v.py::t1", "tests/a.py::t1",
                                       "tests/b.py::t1"]
    groups = [[m.args for m in it.marks if m.name == "xdist_group"] for it in out]
    assert groups == [[("waits",)]] * 3 + [[], []]


def test_the_modules_on_the_kept_ranks_are_one_unit_in_their_order():
    """Tests marked `ranks` (tests/gloo_pool.py's kept processes) are one xdist group across their modules, in
    collection order, costed as their sum: one worker spawns each pool once for all of them."""
    ids = ["tests/a.py::t1", "tests/p.py::t1", "tests/b.py::t1", "tests/q.py::t1", "tests/q.py::t2"]
    costs = {"tests/a.py::t1": {"total": 30.0, "setup": 0.0}, "tests/b.py::t1": {"total": 5.0, "setup": 0.0},
             "tests/p.py::t1": {"total": 8.0, "setup": 7.0}, "tests/q.py::t1": {"total": 20.0, "setup": 9.0},
             "tests/q.py::t2": {"total": 10.0, "setup": 0.0}}
    items = [Item(i, "module") for i in ids]
    for it in items:
        if it.nodeid.split("::")[0] in ("tests/p.py", "tests/q.py"):
            it.add_marker(SimpleNamespace(name=suite_order.RANKS, args=()))
    out = suite_order.order(items, costs)
    assert [i.nodeid for i in out] == ["tests/p.py::t1", "tests/q.py::t1", "tests/q.py::t2", "tests/a.py::t1",
                                       "tests/b.py::t1"]  # 38 s: ahead of the 30 s test
    groups = [[m.args for m in it.marks if m.name == "xdist_group"] for it in out]
    assert groups == [[("ranks",)]] * 3 + [[], []]  # one group each, not also their module's


def test_beside_the_waits_goes_the_costliest_unit_that_keeps_both_cores_busy():
    """With the waits first, the second unit is the costliest of the modules marked `cores`, not the longest unit."""
    ids = ["tests/w.py::t1", "tests/long.py::t1", "tests/g.py::t1", "tests/g.py::t2", "tests/g.py::t3",
           "tests/h.py::t1", "tests/h.py::t2", "tests/h.py::t3", "tests/s.py::t1"]
    costs = {"tests/w.py::t1": {"total": 2.0, "setup": 0.0}, "tests/long.py::t1": {"total": 100.0, "setup": 0.0},
             "tests/g.py::t1": {"total": 30.0, "setup": 20.0}, "tests/g.py::t2": {"total": 20.0, "setup": 0.0},
             "tests/g.py::t3": {"total": 10.0, "setup": 0.0}, "tests/h.py::t1": {"total": 9.0, "setup": 6.0},
             "tests/h.py::t2": {"total": 1.0, "setup": 0.0}, "tests/h.py::t3": {"total": 1.0, "setup": 0.0},
             "tests/s.py::t1": {"total": 10.0, "setup": 0.0}}

    def items(cores):
        its = [Item(i, "module" if i.split("::")[0] in ("tests/g.py", "tests/h.py") else "function") for i in ids]
        its[0].add_marker(SimpleNamespace(name=suite_order.WAITS, args=()))
        for it in its:
            if it.nodeid.split("::")[0] in cores:
                it.add_marker(SimpleNamespace(name=suite_order.CORES, args=()))
        return its
    out = [i.nodeid for i in suite_order.order(items(["tests/h.py"]), costs)]
    assert out == ["tests/w.py::t1", "tests/h.py::t1", "tests/h.py::t2", "tests/h.py::t3", "tests/long.py::t1",
                   "tests/g.py::t1", "tests/g.py::t2", "tests/g.py::t3", "tests/s.py::t1"]
    both = [i.nodeid for i in suite_order.order(items(["tests/g.py", "tests/h.py"]), costs)]
    assert both[1:5] == ["tests/g.py::t1", "tests/g.py::t2", "tests/g.py::t3", "tests/long.py::t1"]  # the costliest
    assert [i.nodeid for i in suite_order.order(items([]), costs)][:2] == ["tests/w.py::t1", "tests/long.py::t1"]


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


def test_a_group_xdist_did_not_tag_is_an_error():
    """check_groups: a grouped test whose id lacks xdist's "@group" suffix stops the run, naming the test."""
    tagged, plain, lost = Item("tests/a.py::t@tests_a.py"), Item("tests/b.py::u"), Item("tests/a.py::v")
    tagged.add_marker(pytest.mark.xdist_group("tests_a.py").mark)
    lost.add_marker(pytest.mark.xdist_group("tests_a.py").mark)
    suite_order.check_groups([tagged, plain])
    with pytest.raises(pytest.fail.Exception,
                       match=r"ignored the xdist_group mark of 1 test\(s\) \(e.g. tests/a.py::v\)"):
        suite_order.check_groups([tagged, plain, lost])


def test_loadgroup_builds_a_grouped_modules_fixture_once(tmp_path):
    """The installed pytest and pytest-xdist, as run.sh runs them: a module marked as one group runs on one worker,
    its module fixture built once (pytest 9 dropped the groups and built it on each worker)."""
    (tmp_path / "test_toy.py").write_text(
        "import os, time, pytest\n"
        "pytestmark = pytest.mark.xdist_group('toy')\n"
        "@pytest.fixture(scope='module')\n"
        "def built():\n"
        f"    open({str(tmp_path / 'built')!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_t(built, i):\n"
        "    time.sleep(0.2)\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", "test_toy.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert len((tmp_path / "built").read_text().split()) == 1, "the group's fixture was built on more than one worker"
