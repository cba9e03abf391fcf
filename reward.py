"""Dense verifier reward r = P / S (T1 paper, section "reward").

Paper (T1, arXiv 2609.11042, reward design): every task ships its own executable verifier that
runs in the sandbox and scores the episode assertion by assertion; the per-assertion report is a
CTRF JSON file. The reward is

    r = P / S,   P = number of passed assertions in the CTRF report,
                 S = 20, one fixed global scale for the whole run,

"neither binary nor a pass rate": an absolute count over a fixed scale means that "a hard task
passing 10 assertions (0.5) and an easy task passing 2 (0.1) get the distinction they deserve",
harder tasks naturally carry more signal, and the critic's regression target stays on the same
scale from step to step (no in-batch scale drift). S = 20 was chosen at about the 90th
percentile of the assertion counts of T1-15k (median 4, max ~35). When the per-assertion
report is missing the paper falls back to the binary outcome. The reward is placed on the last
token of the trajectory; the critic (GAE, gamma = lambda = 1) carries the credit back.

Run:
    python reward.py VERIFIER_DIR [--scale 20]     # prints one JSON line

`VERIFIER_DIR` is the host folder behind the sandbox's /logs/verifier: `ctrf.json` (as written by
`pytest --ctrf`) and `reward.txt` (the 1/0 written by the task's tests/test.sh).

Departures from the paper:
1. Integrity check on the report: a CTRF file whose `results.summary` disagrees with its
   `results.tests` list (counts of tests or passed) is treated as malformed and we fall back to
   the binary outcome. The paper relies on the audit only; this is a cheap guard, not tamper
   proofing (the sandbox clears /logs/verifier before the verifier runs).
2. The binary fallback is reported as passed/total = 1/1 or 0/1 so that "resolved" keeps one
   meaning (passed == total > 0) for both sources. A non-0/1 float in reward.txt (Harbor allows
   float rewards) is used as-is.
3. r is not clipped: a task with more than S assertions can earn r > 1, as in the paper
   (max ~35 assertions -> 1.75).
"""
import argparse
import json
import math
import os

import torch

SCALE = 20  # S: paper, fixed for the whole run (~90th percentile of T1-15k assertion counts)


def _read_ctrf(path):
    """Return (passed, total) from a CTRF report; raise ValueError naming what is wrong."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    results = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(results, dict):
        raise ValueError(f"{path}: missing object 'results'")
    tests = results.get("tests")
    if not isinstance(tests, list):
        raise ValueError(f"{path}: missing list 'results.tests'")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not isinstance(t.get("status"), str):
            raise ValueError(f"{path}: results.tests[{i}] has no string 'status'")
    passed = sum(t["status"] == "passed" for t in tests)
    summary = results.get("summary")
    if isinstance(summary, dict):  # integrity: summary must agree with the per-test list
        if summary.get("tests", len(tests)) != len(tests) or summary.get("passed", passed) != passed:
            raise ValueError(f"{path}: results.summary ({summary.get('passed')}/{summary.get('tests')}) "
                             f"disagrees with results.tests ({passed}/{len(tests)})")
    return passed, len(tests)


def _read_binary(path):
    """Return the float outcome in reward.txt; raise ValueError naming what is wrong."""
    with open(path) as f:
        text = f.read().strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{path}: expected a number, got {text[:40]!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{path}: value {text!r} is not finite")
    return value


def compute(verifier_dir, scale=SCALE):
    """Reward of one trial from its verifier folder.

    Returns dict(reward, passed, total, source, reason) with source in {"ctrf", "binary", "none"};
    reason is None when the CTRF report was used, else why it was not.
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    ctrf_path = os.path.join(verifier_dir, "ctrf.json")
    txt_path = os.path.join(verifier_dir, "reward.txt")
    if os.path.isfile(ctrf_path):
        try:
            passed, total = _read_ctrf(ctrf_path)
            # r = P / S (S fixed for the run)
            return dict(reward=passed / scale, passed=passed, total=total, source="ctrf", reason=None)
        except (ValueError, OSError) as e:
            reason = f"malformed CTRF: {e}"
    else:
        reason = f"missing CTRF: {ctrf_path}"
    if os.path.isfile(txt_path):  # paper: binary outcome when the per-assertion report is missing
        try:
            value = _read_binary(txt_path)
            return dict(reward=value, passed=int(value >= 1.0), total=1, source="binary", reason=reason)
        except (ValueError, OSError) as e:
            reason += f"; malformed reward.txt: {e}"
    else:
        reason += f"; missing {txt_path}"
    return dict(reward=0.0, passed=0, total=0, source="none", reason=reason)


def is_resolved(result):
    """A trial is resolved when every assertion passed (and there was at least one)."""
    return result["total"] > 0 and result["passed"] == result["total"]


def place_on_last_token(reward, length):
    """Per-token reward vector (T,): zeros except the last token, which carries r."""
    if length <= 0:
        raise ValueError(f"length must be >= 1, got {length}")
    rewards = torch.zeros(length, dtype=torch.float32)  # (T,)
    rewards[-1] = float(reward)
    return rewards


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="CTRF report -> r = P/S")
    p.add_argument("verifier_dir")
    p.add_argument("--scale", type=float, default=SCALE)
    a = p.parse_args()
    if not os.path.isdir(a.verifier_dir):
        raise SystemExit(f"reward.py: {a.verifier_dir} is not a directory")
    print(json.dumps(compute(a.verifier_dir, a.scale)))
