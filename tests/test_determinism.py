"""Reproducible to the digit: the tiny pipeline twice with one seed and --deterministic (trials one at a time in
launch order: cluster/actors.run_rollouts) writes the same SFT data, the same SFT and final evaluations byte for
byte and the same RL metrics but for wall times; the two runs go side by side, so their timings differ."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

from test_e2e import TINY, read_metrics, run

TIMING = re.compile(r"time|tok_s|per_s|seconds|wall")  # the figures a clock gives: the only ones allowed to differ


def _untimed(rows):
    return [{k: v for k, v in r.items() if not TIMING.search(k)} for r in rows]


def test_one_seed_twice_gives_the_same_evaluations_and_metrics(tmp_path):
    flags = TINY + ["--deterministic", "true", "--rl-steps", "2", "--seed", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    with ThreadPoolExecutor(2) as pool:  # side by side: each run's timing differs from the other's, its digits not
        list(pool.map(lambda d: run(d, flags, timeout=900), (a, b)))
    assert (a / "samples" / "sft.jsonl").read_bytes() == (b / "samples" / "sft.jsonl").read_bytes()
    for name in ("step_000000.json", "step_000002.json"):  # the SFT and final evaluations of the test split
        ea, eb = (a / "evals" / name).read_bytes(), (b / "evals" / name).read_bytes()
        assert ea == eb, (name, json.loads(ea)["trials"], json.loads(eb)["trials"])
    ma, mb = _untimed(read_metrics(a)), _untimed(read_metrics(b))
    assert [r["phase"] for r in ma] == [r["phase"] for r in mb] and any(r["phase"] == "rl" for r in ma)
    for ra, rb in zip(ma, mb):
        assert ra == rb, (ra, rb)
