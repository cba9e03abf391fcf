"""The suite's order for its parallel workers: longest first, a module with a costly module fixture kept whole.

`bash run.sh test` runs pytest-xdist with `--dist loadgroup --no-loadscope-reorder`: the workers take units in the
collection order, a unit being one test, or every test of one xdist_group (one module). conftest.py calls order()
at collection: with the measured costs of tests/durations.json (seconds per test id: setup + call + teardown, and
setup alone), a module with a module-scoped fixture (a Megatron rank spawn, a Ray session, an engine) whose tests
spent >= GROUP_SETUP_S in set-up becomes one unit, so its fixture is built once, on one worker; then the units are
sorted by cost, longest first (the longest-processing-time rule: the last test to finish starts early). A test the
file does not know costs the median. The tests of modules marked `waits` (their time is spent waiting: deadlines,
terminals, HTTP timeouts, not computing) are one unit, taken first, and the costliest unit of the modules marked
`cores` (Megatron or Ray trainer ranks: ~1.7 machine CPU-s per wall second alone) second: it computes on the other
worker while they wait (beside the waits, a long pipeline or the sandbox audits left a fresh clone's first minutes
half idle). Give such a module more than two tests in one unit (a module fixture groups it): a worker whose first
unit has <= 2 tests is handed the next one too before it starts (an xdist worker runs a test only once it knows the
next). The modules marked `ranks` (their Megatron ranks are tests/gloo_pool.py's, kept per pytest process) are one
unit together, group RANKS: one worker spawns each size of pool once for all of them (spread over the workers, the
4-rank pool was spawned three times, ~30 CPU-s each: results/LOG.md, 2026-12-08). The order changes no test's
behaviour, only which worker runs it and when.

Refresh the costs after adding or changing heavy tests: `T1_TEST_DURATIONS=tests/durations.json bash run.sh test`
(the costs measured are written there at the end of a run, failed tests' too: a cost is a cost).
"""
import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
GROUP_SETUP_S = 5.0  # a module spending this much in set-up is kept on one worker (its module fixtures built once)
WAITS = "waits"  # the marker of a module whose tests mostly wait (one unit, first: `order`)
CORES = "cores"  # ... of a module whose tests keep both cores busy (its costliest unit second, beside the waits)
RANKS = "ranks"  # ... of a module whose tests run on tests/gloo_pool.py's kept ranks (all such modules: one unit)


def _key(nodeid: str) -> str:
    """A test id without the "@group" suffix xdist's loadgroup appends."""
    return nodeid.split("@", 1)[0]


def load(path: Path = DURATIONS) -> dict:
    """{test id: {"total": s, "setup": s}} from `path`; {} when it does not exist. A malformed file is an error
    that names it (a silently ignored file would quietly undo the order)."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
        return {k: {"total": float(v["total"]), "setup": float(v["setup"])} for k, v in doc.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise pytest.UsageError(f"{path}: not a test-durations file ({e}); delete it or rewrite it with "
                                "T1_TEST_DURATIONS=tests/durations.json bash run.sh test") from None


def module_fixture(item) -> bool:
    """Whether the test uses a module- (or class-, package-) scoped fixture: the set-up a group builds once. A
    session fixture is shared anyway (tests/shared_runs.py: across workers by a file lock), so waiting on one is no
    reason to keep a module whole (it had made tests/test_e2e.py's two longest tests one unit)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope in ("module", "class", "package")
                                    for defs in info.name2fixturedefs.values() for d in defs)


def order(items: list, costs: dict) -> list:
    """The items as units sorted by cost, longest first (stable); a module with a module fixture (module_fixture)
    and >= GROUP_SETUP_S of set-up gets an xdist_group mark (one unit); the tests marked RANKS get the group RANKS
    (one unit, in collection order); the tests marked WAITS get the group WAITS, one unit ahead of all others.
    Without costs: the collection order."""
    if not costs:
        return items
    median = statistics.median([c["total"] for c in costs.values()])

    def cost(it):  # a test the file does not know costs the median
        return costs.get(_key(it.nodeid), {"total": median})["total"]

    waiting = [it for it in items if it.get_closest_marker(WAITS)]
    for it in waiting:
        it.add_marker(pytest.mark.xdist_group(WAITS))
    pooled = [it for it in items if it.get_closest_marker(RANKS) and not it.get_closest_marker(WAITS)]
    for it in pooled:
        it.add_marker(pytest.mark.xdist_group(RANKS))
    by_module = defaultdict(list)
    for it in items:
        if not it.get_closest_marker(WAITS) and not it.get_closest_marker(RANKS):
            by_module[it.nodeid.split("::", 1)[0]].append(it)
    units = [(float("inf"), 0, waiting)] if waiting else []  # (cost, first position, items)
    if pooled:
        units.append((sum(map(cost, pooled)), items.index(pooled[0]), pooled))
    for module, its in by_module.items():
        known = [costs[_key(it.nodeid)] for it in its if _key(it.nodeid) in costs]
        if sum(c["setup"] for c in known) >= GROUP_SETUP_S and any(module_fixture(it) for it in its):
            for it in its:
                it.add_marker(pytest.mark.xdist_group(module.replace("/", "_")))
            units.append((sum(map(cost, its)), items.index(its[0]), its))
        else:
            units += [(cost(it), items.index(it), [it]) for it in its]
    units.sort(key=lambda u: (-u[0], u[1]))
    if waiting:  # beside the waits, the costliest unit that keeps both cores busy
        busy = [i for i, u in enumerate(units[1:], 1) if u[2][0].get_closest_marker(CORES)]
        if busy:
            units.insert(1, units.pop(busy[0]))
    return [it for _, _, its in units for it in its]


def check_groups(items: list) -> None:
    """On an xdist worker under --dist loadgroup: every test with an xdist_group mark carries xdist's "@group" id
    suffix, the only way its scheduler sees the group. Under pytest 9 that suffix (written to item._nodeid) no longer
    reaches the id: the groups were dropped without a word, and both workers built a grouped module's fixtures
    (results/LOG.md, 2026-12-07). A loud error instead of a slower suite."""
    lost = [it.nodeid for it in items if it.get_closest_marker("xdist_group") and "@" not in it.nodeid]
    if lost:
        pytest.fail(f"--dist loadgroup ignored the xdist_group mark of {len(lost)} test(s) (e.g. {lost[0]}): pytest "
                    f"{pytest.__version__} with this pytest-xdist does not tag their ids; install requirements.txt's "
                    "pytest (< 9)", pytrace=False)


class Recorder:
    """Sums each test's phases as the controller hears them (xdist sends every report to it)."""

    def __init__(self):
        self.total, self.setup, self.failed = defaultdict(float), defaultdict(float), False

    def add(self, report) -> None:
        k = _key(report.nodeid)
        self.total[k] += report.duration
        if report.when == "setup":
            self.setup[k] += report.duration
        if report.failed:
            self.failed = True

    def write(self, path: Path) -> None:
        """The costs, sorted by test id, to `path` (tmp + rename); nothing when no test ran."""
        if not self.total:
            print(f"\n[suite order] {path} not written: no test ran")
            return
        doc = {k: {"total": round(self.total[k], 2), "setup": round(self.setup[k], 2)} for k in sorted(self.total)}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=0) + "\n")
        tmp.replace(path)
        print(f"\n[suite order] the costs of {len(doc)} tests written to {path}"
              + (" (a test failed: its cost is the time it ran)" if self.failed else ""))
