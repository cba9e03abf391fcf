"""Dense verifier reward r = P / S (T1 paper, section "reward").

Paper (T1, arXiv 2609.11042): each task's verifier scores the episode assertion by assertion in a CTRF report;
r = P / S with P the passed assertions and S = 20 one fixed scale for the whole run (about the 90th percentile
of T1-15k's assertion counts, so r > 1 is possible), "neither binary nor a pass rate"; when the per-assertion
report is missing, the binary outcome (a really solved task never scores 0). The reward sits on the last token.

Run:
    python reward.py VERIFIER_DIR [--scale 20] [--n-assertions N] [--owner-uid UID]  # one JSON line
In code: compute(verifier_dir, scale=SCALE, *, n_assertions=None, owner_uid=None, no_ctrf_reason=None) ->
dict(reward, passed, total, source "ctrf" | "binary" | "none", reason: why a report was not used). VERIFIER_DIR is
the host folder behind /logs/verifier (ctrf.json, reward.txt); n_assertions is the task's own count (data.py's
audit); owner_uid the verifier's host uid. What is refused is listed above `_read_report`.
score_statuses(statuses, scale, *, n_assertions) -> the same dict from per-test CTRF statuses that did not come as
a file: the local jail's verifier reports through a socket (sandbox/verifier_report.py) and its ctrf.json does not pay
there (the agent's code, run by the verifier, can write that file). Source "ctrf" means per-assertion outcomes,
whichever way they came; Daytona, Harbor and sandbox/harbor_run.py's Harbor runs still read the CTRF file.
Standard library only at import (torch inside place_on_last_token): sandbox/jail.py imports this module, and so
does Harbor's venv (sandbox/harbor_env.py), which has no torch.

Departures from the paper:
1. Reports are checked (file type, owner, size, strict CTRF, counts, at most n_assertions tests): the paper relies
   on its audit; here a forged report never pays above the task's full score and a broken one is named.
2. Binary fallback pays v * n_assertions / S for reward.txt's v in [0, 1] (v when n_assertions is unknown; paper
   silent on the scale), so losing the report never pays more than the CTRF report would.
3. r is not clipped (r > 1 above S assertions, as in the paper); a report with fewer tests than n_assertions
   keeps P but reports total = n_assertions, so the task is not "resolved".
"""
import argparse
import errno
import json
import math
import os
import re
import stat
import sys

SCALE = 20  # S: paper, fixed for the whole run (~90th percentile of T1-15k assertion counts)
CTRF_MAX_BYTES = 1 << 20  # paper silent: a real report of ~35 tests with tracebacks is a few tens of KiB
REWARD_TXT_MAX_BYTES = 1024  # paper silent: one number
CTRF_STATUSES = ("passed", "failed", "skipped", "pending", "other")  # the CTRF specification's statuses
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")


# What is refused (a refused report is never used, and `reason` names the file and what is wrong):
# - a report that is not a regular file opened without following links (a symlink, a FIFO, a device, a directory),
#   that has more than one hard link, that is not owned by `owner_uid` (when given), or that is larger than
#   CTRF_MAX_BYTES / REWARD_TXT_MAX_BYTES; files are opened with O_NOFOLLOW and O_NONBLOCK relative to the verifier
#   folder's descriptor and read from that descriptor only;
# - a CTRF report that is not strict JSON (NaN / Infinity, invalid UTF-8), nested deeper than the parser allows,
#   without an object `results` and a list `results.tests`, with a test whose status is not one of CTRF's, with a
#   `results.summary` whose counts are not non-negative integers (bools, floats, strings refused) or do not add up
#   (passed + failed + skipped + pending + other == tests) or disagree with the per-test list, or with more tests
#   than the task's n_assertions (P can never exceed the task's own assertion count);
# - a reward.txt that is not one plain decimal number (ASCII digits, optional fraction and exponent) in [0, 1]:
#   1e30, -0.5, nan, inf and text are refused.
# Binary fallback: a full pass of a 4-assertion task pays 0.2, the same as its full CTRF report (paying 1.0 would
# reward losing the report and move the critic's target off the P/S scale); passed/total are 1/1 or 0/1 so that
# "resolved" (passed == total > 0) keeps one meaning.
def _read_report(dir_fd, name, max_bytes, owner_uid):
    """Bytes of the regular file `name` in the folder `dir_fd`, opened without following a link and read from
    its descriptor; raise ValueError naming the file and what is wrong, FileNotFoundError when absent."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symlink (O_NOFOLLOW); ENXIO: a socket
        what = "a symlink" if e.errno == errno.ELOOP else "cannot be opened"
        raise ValueError(f"{name}: {what} ({e.strerror}); reports are read only as regular files") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name}: not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_nlink != 1:
            raise ValueError(f"{name}: has {st.st_nlink} hard links (a report has exactly one)")
        if owner_uid is not None and st.st_uid != owner_uid:
            raise ValueError(f"{name}: owned by uid {st.st_uid}, not by the verifier's uid {owner_uid}")
        if st.st_size > max_bytes:
            raise ValueError(f"{name}: {st.st_size} bytes, over the cap of {max_bytes} bytes")
        chunks, n = [], 0
        while n <= max_bytes:  # the size may change after fstat: never read more than the cap + 1
            b = os.read(fd, max_bytes + 1 - n)
            if not b:
                break
            chunks.append(b)
            n += len(b)
        if n > max_bytes:
            raise ValueError(f"{name}: grew past the cap of {max_bytes} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _short(v):
    """repr of a value from a report, cut to 40 characters (a report may hold a 4000-digit number)."""
    r = repr(v) if not isinstance(v, int) or abs(v) < 10 ** 30 else f"<{len(str(abs(v)))}-digit integer>"
    return r if len(r) <= 40 else r[:37] + "..."


def _count(summary, key, where):
    """A summary count: a non-negative int (not a bool); absent counts are 0."""
    v = summary.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}.{key} must be a non-negative integer, got {_short(v)}")
    return v


def _no_constant(name):
    raise ValueError(f"{name} is not strict JSON")


def _parse_ctrf(raw, n_assertions):
    """Return (passed, total) from the bytes of a CTRF report; raise ValueError naming what is wrong."""
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested deeper than the JSON parser allows (a CTRF report is a few levels deep)") from None
    except ValueError as e:  # JSONDecodeError, invalid UTF-8, NaN / Infinity, a 5000-digit integer
        raise ValueError(f"not valid JSON ({e})") from None
    results = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(results, dict):
        raise ValueError("missing object 'results'")
    tests = results.get("tests")
    if not isinstance(tests, list):
        raise ValueError("missing list 'results.tests'")
    counts = dict.fromkeys(CTRF_STATUSES, 0)
    for i, t in enumerate(tests):
        status = t.get("status") if isinstance(t, dict) else None
        if not isinstance(status, str):
            raise ValueError(f"results.tests[{i}] has no string 'status'")
        if status not in counts:
            raise ValueError(f"results.tests[{i}].status {status[:40]!r} is not one of {', '.join(CTRF_STATUSES)}")
        counts[status] += 1
    summary = results.get("summary")
    if summary is not None:  # integrity: the summary adds up and agrees with the per-test list
        if not isinstance(summary, dict):
            raise ValueError(f"results.summary must be an object, got {type(summary).__name__}")
        n_tests = _count(summary, "tests", "results.summary")
        got = {k: _count(summary, k, "results.summary") for k in CTRF_STATUSES}
        if sum(got.values()) != n_tests:
            terms = " + ".join(_short(got[k]) for k in CTRF_STATUSES)
            raise ValueError(f"results.summary counts do not add up: {terms} != tests {_short(n_tests)}")
        if n_tests != len(tests) or got != counts:
            said = ", ".join(f"{k} {_short(v)}" for k, v in got.items())
            raise ValueError(f"results.summary ({_short(n_tests)} tests: {said}) disagrees with results.tests "
                             f"({len(tests)} tests: {counts})")
    if n_assertions is not None and len(tests) > n_assertions:  # P never above the task's own count
        raise ValueError(f"{len(tests)} tests, more than the task's {n_assertions} assertions (recorded at audit)")
    return counts["passed"], len(tests)


def _parse_binary(raw):
    """Return the outcome in reward.txt: one plain decimal number in [0, 1]; raise ValueError naming what is wrong."""
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"not ASCII text: {raw[:40]!r}") from None
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"expected one number in [0, 1], got {text[:40]!r}")
    value = float(text)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"value {text[:40]!r} is outside [0, 1]")
    return value


def _check_args(scale, n_assertions):
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if n_assertions is not None and (isinstance(n_assertions, bool) or not isinstance(n_assertions, int)
                                     or n_assertions <= 0):
        raise ValueError(f"n_assertions must be a positive integer or None, got {n_assertions!r}")


def score_statuses(statuses, scale=SCALE, *, n_assertions=None, origin="the per-test report"):
    """Reward from per-test CTRF statuses received other than as a file (sandbox/jail.py's report channel): the same
    rules as a CTRF report (P = the passed tests, r = P / S; fewer tests than n_assertions: total = n_assertions),
    except that more tests than n_assertions pays 0 (no fallback: the caller's reward.txt is no safer). Source
    "ctrf" (per-assertion outcomes, whatever carried them); origin names the carrier in a reason."""
    _check_args(scale, n_assertions)
    statuses = list(statuses)
    bad = [s for s in statuses if s not in CTRF_STATUSES]
    if bad:
        raise ValueError(f"{origin}: status {_short(bad[0])} is not one of {', '.join(CTRF_STATUSES)}")
    passed, total = statuses.count("passed"), len(statuses)
    if n_assertions is not None and total > n_assertions:  # P never above the task's own count
        return dict(reward=0.0, passed=0, total=0, source="none",
                    reason=f"{origin}: {total} tests, more than the task's {n_assertions} assertions (recorded at "
                           f"audit)")
    return _per_test(passed, total, scale, n_assertions, origin)


def _per_test(passed, total, scale, n_assertions, origin):
    """The reward of P passed of `total` per-test outcomes (a CTRF file or the report channel, named by origin):
    r = P / S; fewer tests than n_assertions keeps P but reports total = n_assertions (departure 3: not resolved
    unless all ran)."""
    reason = None
    if n_assertions is not None and total < n_assertions:
        reason = f"{origin} lists {total} tests of the task's {n_assertions} assertions: total = {n_assertions}"
        total = n_assertions
    return dict(reward=passed / scale, passed=passed, total=total, source="ctrf", reason=reason)  # r = P / S


class _NotRead(Exception):
    """compute(no_ctrf_reason=...): the CTRF file is not read."""


def compute(verifier_dir, scale=SCALE, *, n_assertions=None, owner_uid=None, no_ctrf_reason=None):
    """Reward of one trial from its verifier folder (see the module docstring for what is refused).

    scale: S of r = P / S. n_assertions: the task's assertion count recorded at audit; a CTRF report with
    more tests is refused, and the binary fallback pays v * n_assertions / S. owner_uid: the uid the
    verifier ran as; a report owned by anyone else is refused. no_ctrf_reason: when given, ctrf.json is not read
    (the caller has its own per-test report, or knows the file cannot be trusted) and this is the reason given.
    r may exceed 1 (a task with more than S assertions, as in the paper). Returns dict(reward, passed, total,
    source, reason) with source in {"ctrf", "binary", "none"}; reason is None when the CTRF report was used as
    is, else why not.
    """
    _check_args(scale, n_assertions)
    if owner_uid is not None and (isinstance(owner_uid, bool) or not isinstance(owner_uid, int) or owner_uid < 0):
        raise ValueError(f"owner_uid must be a non-negative integer or None, got {owner_uid!r}")
    try:
        dir_fd = os.open(verifier_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return dict(reward=0.0, passed=0, total=0, source="none",
                    reason=f"verifier dir {verifier_dir}: cannot be opened as a directory without following a "
                           f"link ({e.strerror})")
    try:
        try:
            if no_ctrf_reason is not None:
                raise _NotRead(no_ctrf_reason)
            passed, total = _parse_ctrf(_read_report(dir_fd, "ctrf.json", CTRF_MAX_BYTES, owner_uid), n_assertions)
            return _per_test(passed, total, scale, n_assertions, "CTRF")
        except _NotRead as e:
            reason = str(e)
        except FileNotFoundError:
            reason = f"missing CTRF: {os.path.join(verifier_dir, 'ctrf.json')}"
        except (ValueError, OSError) as e:
            reason = f"malformed CTRF: {os.path.join(verifier_dir, 'ctrf.json')}: {e}"
        try:  # paper: the binary outcome when the per-assertion report is missing
            value = _parse_binary(_read_report(dir_fd, "reward.txt", REWARD_TXT_MAX_BYTES, owner_uid))
            r = value * n_assertions / scale if n_assertions is not None else value  # departure 2
            return dict(reward=r, passed=int(value >= 1.0), total=1, source="binary", reason=reason)
        except FileNotFoundError:
            reason += f"; missing {os.path.join(verifier_dir, 'reward.txt')}"
        except (ValueError, OSError) as e:
            reason += f"; malformed reward.txt: {os.path.join(verifier_dir, 'reward.txt')}: {e}"
        return dict(reward=0.0, passed=0, total=0, source="none", reason=reason)
    finally:
        os.close(dir_fd)


def is_resolved(result):
    """A trial is resolved when every assertion passed (and there was at least one)."""
    return result["total"] > 0 and result["passed"] == result["total"]


def place_on_last_token(reward, length):
    """Per-token reward vector (T,): zeros except the last token, which carries r."""
    import torch  # here, not at the top: Harbor's venv imports this module (through sandbox/jail.py) without torch
    if length <= 0:
        raise ValueError(f"length must be >= 1, got {length}")
    rewards = torch.zeros(length, dtype=torch.float32)  # (T,)
    rewards[-1] = float(reward)
    return rewards


def build_parser():
    """The command line: one verifier folder -> its reward as one JSON line."""
    p = argparse.ArgumentParser(description="Score a verifier's report folder: r = P / S from its CTRF report, else "
                                            "the binary reward.txt; prints one JSON line.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("verifier_dir", help="the host folder behind the trial's /logs/verifier (ctrf.json, reward.txt)")
    p.add_argument("--scale", type=float, default=SCALE, help="S of r = P/S (paper: 20)")
    p.add_argument("--n-assertions", type=int, default=None,
                   help="the task's assertion count (recorded at audit); None: not checked")
    p.add_argument("--owner-uid", type=int, default=None, help="refuse reports not owned by this uid; None: any owner")
    return p


def main(a):
    """Print compute's dict for a.verifier_dir as one JSON line; a bad folder or report exits non-zero."""
    if not os.path.isdir(a.verifier_dir) or os.path.islink(a.verifier_dir):
        raise SystemExit(f"reward.py: {a.verifier_dir} is not a directory (or is a symlink)")
    try:
        print(json.dumps(compute(a.verifier_dir, a.scale, n_assertions=a.n_assertions, owner_uid=a.owner_uid)))
    except ValueError as e:
        raise SystemExit(f"reward.py: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
