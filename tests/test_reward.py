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
