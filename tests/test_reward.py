"""Tests for reward.py: r = P/S from a real `pytest --ctrf` report, binary fallback, last token."""
import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import reward  # noqa: E402

VERIFIER = '''
def test_one():
    assert 1 + 1 == 2
def test_two():
    assert "a" in "abc"
def test_three():
    assert [1, 2] == [1, 2]
def test_four_fails():
    assert 2 + 2 == 5
def test_five_fails():
    assert False, "nope"
'''


def _run_pytest_ctrf(tmp_path):
    (tmp_path / "test_outputs.py").write_text(VERIFIER)
    vdir = tmp_path / "verifier"
    vdir.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest", "--ctrf", str(vdir / "ctrf.json"),
                           "test_outputs.py", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some tests fail
    (vdir / "reward.txt").write_text("0\n")
    return vdir


def test_reward_is_passed_over_fixed_scale_on_real_ctrf(tmp_path):
    vdir = _run_pytest_ctrf(tmp_path)
    res = reward.compute(str(vdir))
    assert res == dict(reward=3 / 20, passed=3, total=5, source="ctrf", reason=None)
    assert reward.compute(str(vdir), scale=10)["reward"] == pytest.approx(0.3)
    assert not reward.is_resolved(res)


def test_reward_is_not_clipped_above_one(tmp_path):
    tests = [{"name": f"t{i}", "status": "passed"} for i in range(30)]
    (tmp_path / "ctrf.json").write_text(json.dumps({"results": {"tests": tests}}))
    res = reward.compute(str(tmp_path))
    assert res["reward"] == pytest.approx(1.5) and reward.is_resolved(res)


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    (json.dumps({"results": {}}), "results.tests"),
    (json.dumps({"results": {"tests": [{"name": "x"}]}}), "status"),
    (json.dumps({"results": {"summary": {"tests": 2, "passed": 2},
                             "tests": [{"name": "x", "status": "passed"}]}}), "disagrees"),
])
def test_malformed_ctrf_falls_back_to_binary_with_reason(tmp_path, content, needle):
    (tmp_path / "ctrf.json").write_text(content)
    (tmp_path / "reward.txt").write_text("1\n")
    res = reward.compute(str(tmp_path))
    assert res["source"] == "binary" and res["reward"] == 1.0
    assert res["passed"] == 1 and res["total"] == 1
    assert "malformed CTRF" in res["reason"] and needle in res["reason"]


def test_missing_ctrf_falls_back_to_binary(tmp_path):
    (tmp_path / "reward.txt").write_text("0")
    res = reward.compute(str(tmp_path))
    assert res["source"] == "binary" and res["reward"] == 0.0 and res["passed"] == 0
    assert "missing CTRF" in res["reason"]


def test_neither_report_gives_zero(tmp_path):
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none" and res["reward"] == 0.0 and res["total"] == 0
    (tmp_path / "reward.txt").write_text("garbage")
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none" and "reward.txt" in res["reason"]


def test_place_on_last_token():
    r = reward.place_on_last_token(0.35, 6)
    assert r.shape == (6,) and r.dtype == torch.float32
    assert torch.equal(r[:-1], torch.zeros(5)) and r[-1].item() == pytest.approx(0.35)
    assert reward.place_on_last_token(1.0, 1).tolist() == [1.0]
    with pytest.raises(ValueError, match="length"):
        reward.place_on_last_token(1.0, 0)


def test_cli_prints_one_json_line(tmp_path):
    vdir = _run_pytest_ctrf(tmp_path)
    out = subprocess.run([sys.executable, os.path.join(HERE, "reward.py"), str(vdir)],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()
    assert len(out) == 1
    d = json.loads(out[0])
    assert (d["reward"], d["passed"], d["total"], d["source"]) == (0.15, 3, 5, "ctrf")


# --- what is refused (rewards are bounded and strict; reports read only as the verifier's regular files)
def _ctrf(n_tests, n_passed=None, summary=True, **summary_overrides):
    n_passed = n_tests if n_passed is None else n_passed
    tests = [{"name": f"t{i}", "status": "passed" if i < n_passed else "failed"} for i in range(n_tests)]
    results = {"tests": tests}
    if summary:
        results["summary"] = dict(tests=n_tests, passed=n_passed, failed=n_tests - n_passed, skipped=0, pending=0,
                                  other=0, start=0, stop=1, **summary_overrides)
    return json.dumps({"results": results})


def test_symlinked_reports_are_refused(tmp_path):
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "ctrf.json").write_text(_ctrf(400))
    (forged / "reward.txt").write_text("1\n")
    vdir = tmp_path / "verifier"
    vdir.mkdir()
    (vdir / "ctrf.json").symlink_to(forged / "ctrf.json")
    (vdir / "reward.txt").symlink_to(forged / "reward.txt")
    res = reward.compute(str(vdir))
    assert res["source"] == "none" and res["reward"] == 0.0 and res["total"] == 0
    assert "malformed CTRF" in res["reason"] and "ctrf.json: a symlink" in res["reason"]
    assert "malformed reward.txt" in res["reason"] and "reward.txt: a symlink" in res["reason"]


def test_symlinked_verifier_dir_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "ctrf.json").write_text(_ctrf(3))
    (tmp_path / "verifier").symlink_to(real)
    res = reward.compute(str(tmp_path / "verifier"))
    assert res["source"] == "none" and res["reward"] == 0.0 and "without following a link" in res["reason"]


def test_fifo_or_directory_named_like_a_report_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "ctrf.json")  # a plain open() would block here until a writer appears
    os.mkdir(tmp_path / "reward.txt")
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none" and res["reward"] == 0.0
    assert "ctrf.json: not a regular file" in res["reason"] and "reward.txt: not a regular file" in res["reason"]
    os.unlink(tmp_path / "ctrf.json")
    os.mkdir(tmp_path / "ctrf.json")
    os.rmdir(tmp_path / "reward.txt")
    os.mkfifo(tmp_path / "reward.txt")
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none"
    assert "ctrf.json: not a regular file" in res["reason"] and "reward.txt: not a regular file" in res["reason"]


def test_report_not_owned_by_the_verifier_is_refused(tmp_path):
    (tmp_path / "ctrf.json").write_text(_ctrf(3))
    (tmp_path / "reward.txt").write_text("1\n")
    me = os.getuid()
    other = me + 4242
    res = reward.compute(str(tmp_path), owner_uid=other)
    assert res["source"] == "none" and res["reward"] == 0.0
    assert f"owned by uid {me}, not by the verifier's uid {other}" in res["reason"]
    assert reward.compute(str(tmp_path), owner_uid=me)["source"] == "ctrf"
    if me == 0:  # root can hand the file to another uid: the verifier's uid then owns it
        os.chown(tmp_path / "ctrf.json", other, other)
        assert reward.compute(str(tmp_path), owner_uid=other)["reward"] == pytest.approx(3 / 20)
        assert "not by the verifier's uid 0" in reward.compute(str(tmp_path), owner_uid=0)["reason"]


def test_hard_linked_report_is_refused(tmp_path):
    (tmp_path / "elsewhere.json").write_text(_ctrf(3))
    vdir = tmp_path / "v"
    vdir.mkdir()
    os.link(tmp_path / "elsewhere.json", vdir / "ctrf.json")
    res = reward.compute(str(vdir))
    assert res["source"] == "none" and "2 hard links" in res["reason"]


def test_more_tests_than_the_task_has_assertions_is_refused(tmp_path):
    (tmp_path / "ctrf.json").write_text(_ctrf(400))  # a forged 400-of-400 on a 5-assertion task
    res = reward.compute(str(tmp_path), n_assertions=5)
    assert res["source"] == "none" and res["reward"] == 0.0
    assert "400 tests, more than the task's 5 assertions" in res["reason"]
    (tmp_path / "reward.txt").write_text("1\n")
    res = reward.compute(str(tmp_path), n_assertions=5)  # binary fallback: never above the task's full score
    assert res["source"] == "binary" and res["reward"] == pytest.approx(5 / 20) and "400 tests" in res["reason"]
    (tmp_path / "ctrf.json").write_text(_ctrf(5))
    res = reward.compute(str(tmp_path), n_assertions=5)
    assert res == dict(reward=5 / 20, passed=5, total=5, source="ctrf", reason=None) and reward.is_resolved(res)


def test_fewer_tests_than_the_task_has_assertions_is_not_resolved(tmp_path):
    (tmp_path / "ctrf.json").write_text(_ctrf(1))  # 1-of-1 on a 5-assertion task: P counts, not resolved
    res = reward.compute(str(tmp_path), n_assertions=5)
    assert res["source"] == "ctrf" and res["reward"] == pytest.approx(1 / 20)
    assert (res["passed"], res["total"]) == (1, 5) and not reward.is_resolved(res)
    assert "1 tests of the task's 5 assertions" in res["reason"]


def test_more_assertions_than_scale_gives_reward_above_one(tmp_path):
    (tmp_path / "ctrf.json").write_text(_ctrf(35))  # paper: up to ~35 assertions, S = 20
    res = reward.compute(str(tmp_path), n_assertions=35)
    assert res["source"] == "ctrf" and res["reward"] == pytest.approx(35 / 20)


@pytest.mark.parametrize("overrides, needle", [
    (dict(passed=-1, failed=4), "results.summary.passed must be a non-negative integer, got -1"),
    (dict(passed=True), "results.summary.passed must be a non-negative integer, got True"),
    (dict(failed=False, passed=3), "results.summary.failed must be a non-negative integer, got False"),
    (dict(passed=3.0), "results.summary.passed must be a non-negative integer, got 3.0"),
    (dict(tests="3"), "results.summary.tests must be a non-negative integer, got '3'"),
    (dict(skipped=2), "do not add up: 3 + 0 + 2 + 0 + 0 != tests 3"),
    (dict(tests=400), "do not add up: 3 + 0 + 0 + 0 + 0 != tests 400"),
    (dict(tests=5, passed=5), "disagrees with results.tests"),
    (dict(passed=1, failed=2), "disagrees with results.tests"),
])
def test_inconsistent_ctrf_summary_is_refused(tmp_path, overrides, needle):
    doc = json.loads(_ctrf(3))
    doc["results"]["summary"].update(overrides)
    (tmp_path / "ctrf.json").write_text(json.dumps(doc))
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none" and res["reward"] == 0.0
    assert "malformed CTRF" in res["reason"] and needle in res["reason"], res["reason"]


@pytest.mark.parametrize("content, needle", [
    (json.dumps({"results": {"tests": [{"name": "x", "status": "PASSED!"}]}}), "is not one of passed, failed"),
    (json.dumps({"results": {"tests": [], "summary": [3]}}), "results.summary must be an object"),
    ('{"results": {"tests": [], "summary": {"tests": NaN}}}', "NaN is not strict JSON"),
    (b'{"results": {"tests": [{"status": "passed\xff"}]}}', "not valid JSON"),
    ('{"results": {"tests": [], "summary": {"tests": ' + "9" * 5000 + "}}}", "not valid JSON"),
])
def test_non_ctrf_status_or_non_strict_json_is_refused(tmp_path, content, needle):
    p = tmp_path / "ctrf.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none" and needle in res["reason"], res["reason"]


def test_deeply_nested_json_is_a_clear_error(tmp_path):
    depth = 100_000
    (tmp_path / "ctrf.json").write_text('{"results": ' + "[" * depth + "]" * depth + "}")
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none" and "nested deeper than the JSON parser allows" in res["reason"]


def test_oversized_ctrf_is_refused_before_it_is_read(tmp_path):
    with open(tmp_path / "ctrf.json", "wb") as f:
        f.truncate(50 << 20)  # 50 MB (sparse): refused on its size, never read or parsed
    (tmp_path / "reward.txt").write_bytes(b"1" * 5000)
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none"
    assert f"{50 << 20} bytes, over the cap of {reward.CTRF_MAX_BYTES} bytes" in res["reason"]
    assert f"5000 bytes, over the cap of {reward.REWARD_TXT_MAX_BYTES} bytes" in res["reason"]


@pytest.mark.parametrize("text, value", [
    ("1.0\n", 1.0), ("0.5", 0.5), ("0\n", 0.0), (" 1 \n", 1.0), (".25", 0.25), ("1e-1", 0.1),
    ("1e30", None), ("-0.5", None), ("nan", None), ("inf", None), ("-inf", None), ("1.5", None),
    ("1_0", None), ("0x1", None), ("", None), ("1 1", None), ("\uff11", None), ("true", None),
])
def test_reward_txt_is_a_finite_number_in_unit_interval(tmp_path, text, value):
    (tmp_path / "reward.txt").write_bytes(text.encode())
    res = reward.compute(str(tmp_path))
    if value is None:
        assert res["source"] == "none" and res["reward"] == 0.0 and res["total"] == 0
        assert "missing CTRF" in res["reason"] and "malformed reward.txt" in res["reason"]
    else:
        assert res["source"] == "binary" and res["reward"] == pytest.approx(value) and "missing CTRF" in res["reason"]


def test_binary_fallback_pays_at_most_the_task_full_dense_score(tmp_path):
    (tmp_path / "reward.txt").write_text("1\n")
    assert reward.compute(str(tmp_path), n_assertions=4)["reward"] == pytest.approx(4 / 20)  # = a full CTRF pass
    assert reward.compute(str(tmp_path), scale=10, n_assertions=4)["reward"] == pytest.approx(0.4)
    res = reward.compute(str(tmp_path))  # no recorded count: the paper's literal binary outcome
    assert res["reward"] == 1.0 and (res["passed"], res["total"]) == (1, 1) and reward.is_resolved(res)
    (tmp_path / "reward.txt").write_text("0.5\n")
    res = reward.compute(str(tmp_path), n_assertions=4)
    assert res["reward"] == pytest.approx(0.1) and not reward.is_resolved(res)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(scale=0), "scale"), (dict(scale=float("inf")), "scale"), (dict(scale=True), "scale"),
    (dict(scale="20"), "scale"), (dict(n_assertions=0), "n_assertions"), (dict(n_assertions=True), "n_assertions"),
    (dict(n_assertions=2.0), "n_assertions"), (dict(owner_uid=-1), "owner_uid"), (dict(owner_uid="0"), "owner_uid"),
])
def test_bad_arguments_raise_naming_them(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        reward.compute(str(tmp_path), **kwargs)


def test_real_ctrf_accepted_with_the_task_count_and_verifier_uid(tmp_path):
    vdir = _run_pytest_ctrf(tmp_path)
    res = reward.compute(str(vdir), n_assertions=5, owner_uid=os.getuid())
    assert res == dict(reward=3 / 20, passed=3, total=5, source="ctrf", reason=None)


def test_cli_exits_nonzero_on_a_bad_dir(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for bad in (tmp_path / "nope", tmp_path / "file", tmp_path / "link"):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "reward.py"), str(bad)],
                              capture_output=True, text=True)
        assert proc.returncode != 0 and "is not a directory" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, os.path.join(HERE, "reward.py"), str(tmp_path / "real"), "--scale", "0"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "scale must be a positive finite number" in proc.stderr
    (tmp_path / "real" / "ctrf.json").write_text(_ctrf(400))
    out = subprocess.run([sys.executable, os.path.join(HERE, "reward.py"), str(tmp_path / "real"),
                          "--n-assertions", "5"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["source"] == "none" and "more than the task's 5 assertions" in json.loads(out)["reason"]


def test_reason_stays_short_for_a_huge_number_in_the_report(tmp_path):
    (tmp_path / "ctrf.json").write_text('{"results": {"tests": [], "summary": {"tests": ' + "1" * 4000 + "}}}")
    res = reward.compute(str(tmp_path))
    assert res["source"] == "none" and "<4000-digit integer>" in res["reason"] and len(res["reason"]) < 400


# --- per-test statuses that came other than as a file (the local jail's report channel) ------------------------
def test_score_statuses_follows_the_ctrf_rules_without_a_fallback():
    res = reward.score_statuses(["passed", "failed", "skipped", "passed"], 20)
    assert res == dict(reward=2 / 20, passed=2, total=4, source="ctrf", reason=None)
    res = reward.score_statuses(["passed"], 20, n_assertions=3, origin="the channel")
    assert (res["passed"], res["total"]) == (1, 3) and "the channel lists 1 tests of the task's 3" in res["reason"]
    res = reward.score_statuses(["passed"] * 6, 20, n_assertions=5)  # a forged count pays 0, nothing falls back
    assert (res["reward"], res["source"]) == (0.0, "none") and "6 tests, more than the task's 5" in res["reason"]
    with pytest.raises(ValueError, match="'PASSED' is not one of"):
        reward.score_statuses(["PASSED"], 20)
    with pytest.raises(ValueError, match="scale"):
        reward.score_statuses([], 0)


def test_compute_can_leave_the_ctrf_file_unread(tmp_path):
    (tmp_path / "ctrf.json").write_text(_ctrf(400))  # a forgery the local jail no longer reads
    (tmp_path / "reward.txt").write_text("1\n")
    res = reward.compute(str(tmp_path), n_assertions=5, no_ctrf_reason="missing CTRF: not read here")
    assert (res["source"], res["reward"]) == ("binary", 5 / 20) and res["reason"] == "missing CTRF: not read here"
    os.unlink(tmp_path / "reward.txt")
    res = reward.compute(str(tmp_path), no_ctrf_reason="missing CTRF: not read here")
    assert res["source"] == "none" and res["reason"].startswith("missing CTRF: not read here; missing ")
