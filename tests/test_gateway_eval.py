"""engine/gateway.py eval / harbor-trial never give a silent zero: nothing to evaluate, tasks the jail cannot run,
Harbor's own failures and a stop by signal each end non-zero with a named reason. Harbor is a stand-in script here
(its venv is --harbor-venv); no engine is contacted."""
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from engine import gateway
from sandbox import harbor_run
from test_rollout import make_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Harbor's result.json when its environment cannot start (what `harbor trial start` writes, then exits 0)
ENV_FAILS = """#!/bin/bash
echo "$4" >> "$(dirname "$0")/../../calls.log"
exec "$(dirname "$0")/python" - "$4" <<'PY'
import json, os, sys
cfg = json.load(open(sys.argv[1]))
d = os.path.join(cfg["trials_dir"], cfg["trial_name"])
os.makedirs(d, exist_ok=True)
json.dump({"exception_info": {"exception_type": "RuntimeError", "exception_message": "docker: command not found"},
           "verifier_result": None}, open(os.path.join(d, "result.json"), "w"))
PY
"""
# a Harbor that runs a long time with a child in its process group
RUNS_LONG = """#!/bin/bash
echo $$ > "$(dirname "$0")/../../harbor.pid"
sleep 600 &
echo $! > "$(dirname "$0")/../../child.pid"
wait
"""


def fake_harbor(root, script):
    venv = root / "fake-harbor"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    (venv / "bin" / "harbor").write_text(script)
    os.chmod(venv / "bin" / "harbor", 0o755)
    return venv


@pytest.fixture()
def tok_dir(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


@pytest.fixture()
def signals_restored():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def run_main(args, tok_dir, capsys):
    try:
        rc = gateway.main([*args, "--engine-url", "http://127.0.0.1:9", "--model-path", tok_dir])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_eval_of_nothing_exits_2_naming_the_reason(tmp_path, tok_dir, capsys, signals_restored):
    """An empty dir printed solve_rate 0.0 and exited 0; a dir without task dirs, or a file, likewise."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-tasks" / "a").mkdir(parents=True)
    (tmp_path / "no-tasks" / "a" / "instruction.md").write_text("x")
    (tmp_path / "a-file").write_text("x")
    for d, why in (("empty", "holds no task dir"), ("no-tasks", "holds no task dir"), ("a-file", "not a directory"),
                   ("missing", "not a directory")):
        rc, out, err = run_main(["eval", "--dataset", str(tmp_path / d)], tok_dir, capsys)
        assert rc == 2 and why in err and str(tmp_path / d) in err and "solve_rate" not in out, (d, rc, out, err)


def test_a_missing_or_empty_model_path_is_one_line_exit_2(tmp_path, capsys, signals_restored):
    data = tmp_path / "dataset"
    data.mkdir()
    make_task(data, "runs-here")
    (tmp_path / "empty").mkdir()
    for path, why in ((tmp_path / "missing", "is not a directory"), (tmp_path / "empty", "no tokenizer loads")):
        for cmd in (["eval", "--dataset", str(data)], ["harbor-trial", "--task", str(data / "runs-here")]):
            rc, out, err = run_main(cmd, str(path), capsys)
            assert rc == 2 and "--model-path: " in err and why in err and "Traceback" not in err, (cmd, rc, err)


def test_eval_refuses_tasks_the_jail_cannot_run_and_harbor_failing_is_an_error(tmp_path, tok_dir, capsys,
                                                                             signals_restored):
    """A task that needs its image (rollout.check_runs_here) is refused up front, Harbor never starts for it; a trial
    whose Harbor environment failed (no verifier result) is an error with Harbor's reason, not a reward of 0."""
    data = tmp_path / "dataset"
    data.mkdir()
    make_task(data, "runs-here")
    needs = make_task(data, "needs-image")
    with open(needs / "task.toml", "a") as f:
        f.write('\n[environment]\ndocker_image = "ghcr.io/example/needs:1"\n')
    venv = fake_harbor(tmp_path, ENV_FAILS)
    t0 = time.time()
    rc, out, err = run_main(["eval", "--dataset", str(data), "--attempts", "2", "--harbor-venv", str(venv),
                             "--trials-dir", str(tmp_path / "trials")], tok_dir, capsys)
    rep = json.loads(out)
    assert rc == 1 and time.time() - t0 < 60, (rc, err)
    calls = (tmp_path / "calls.log").read_text().split()
    assert len(calls) == 2 and all("runs-here" in c for c in calls)  # Harbor ran only the task that runs here
    assert rep["n_trials"] == 4 and rep["n_errors"] == 4 and rep["solve_rate"] == 0.0
    assert "docker_image" in rep["refused"]["needs-image"]
    errors = {(e["task"], e["attempt"]): e["error"] for e in rep["errors"]}
    assert all("refused before running" in errors[("needs-image", k)] for k in (0, 1))
    assert all("RuntimeError: docker: command not found" in errors[("runs-here", k)] for k in (0, 1))
    assert "4 of 4 trials had no verdict" in err and "1 tasks refused" in err
    # every task refused: evaluated nothing, exit 2; harbor-trial on a failing Harbor: exit 1 with the reason
    (data / "runs-here" / "task.toml").write_text('[environment]\ndocker_image = "x"\n')
    rc, out, err = run_main(["eval", "--dataset", str(data), "--harbor-venv", str(venv)], tok_dir, capsys)
    assert rc == 2 and "evaluated nothing: all 2 tasks refused" in err, (rc, err)
    assert len((tmp_path / "calls.log").read_text().split()) == 2
    rc, out, err = run_main(["harbor-trial", "--task", str(needs), "--harbor-venv", str(venv), "--trials-dir",
                             str(tmp_path / "trials")], tok_dir, capsys)
    assert rc == 1 and json.loads(out)["exit_reason"] == "error" and "docker_image" in err, (rc, err)


def test_harbor_outcome_needs_a_verifier_result(tmp_path):
    assert "wrote no" in harbor_run.harbor_outcome(str(tmp_path))
    (tmp_path / "result.json").write_text("{not json")
    assert "not JSON" in harbor_run.harbor_outcome(str(tmp_path))
    (tmp_path / "result.json").write_text(json.dumps({"exception_info": {"exception_type": "VerifierTimeoutError",
                                                                         "exception_message": "900 s"}}))
    assert "VerifierTimeoutError: 900 s" in harbor_run.harbor_outcome(str(tmp_path))
    (tmp_path / "result.json").write_text(json.dumps({"verifier_result": {"rewards": {"reward": 0.0}},
                                                      "exception_info": {"exception_type": "AgentTimeoutError"}}))
    assert harbor_run.harbor_outcome(str(tmp_path)) is None  # the agent timed out, the verifier ran: a verdict


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] == "Z"  # a zombie is gone too
    except FileNotFoundError:
        return True


def test_sigint_ends_the_harbor_groups_started_here(signals_restored):
    """The handler main() installs for SIGINT (as for SIGTERM): the stop event is set, every Harbor group ends."""
    stop = harbor_run.threading.Event()
    got = harbor_run.on_signal(stop)
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    with harbor_run._harbor_lock:
        harbor_run._harbor_groups.add(p.pid)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert p.wait(timeout=10) == -signal.SIGTERM and stop.is_set() and got == [signal.SIGINT]
    finally:
        with harbor_run._harbor_lock:
            harbor_run._harbor_groups.discard(p.pid)
        if p.poll() is None:
            p.kill()


def test_sigterm_stops_evals_harbor_process_group(tmp_path, tok_dir):
    """Killing `python -m engine.gateway eval` ends Harbor's process group (its own session, which would outlive
    it) with it, and the eval exits 128 + the signal."""
    sig = signal.SIGTERM
    data = tmp_path / "dataset"
    data.mkdir()
    make_task(data, "runs-here")
    venv = fake_harbor(tmp_path, RUNS_LONG)
    p = subprocess.Popen([sys.executable, "-m", "engine.gateway", "eval", "--dataset", str(data),
                          "--engine-url", "http://127.0.0.1:9", "--model-path", tok_dir, "--attempts", "1",
                          "--harbor-venv", str(venv), "--trials-dir", str(tmp_path / "trials")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True)
    child = tmp_path / "child.pid"
    try:
        deadline = time.time() + 120  # the import of gateway (torch, transformers) on a loaded machine
        while not child.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert child.exists(), p.communicate(timeout=30)
        time.sleep(0.2)
        harbor, sleeper = int((tmp_path / "harbor.pid").read_text()), int(child.read_text())
        assert os.getpgid(sleeper) == harbor  # Harbor's own group, not ours
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 128 + sig, (p.returncode, out, err)
        deadline = time.time() + 10
        while not (gone(harbor) and gone(sleeper)) and time.time() < deadline:
            time.sleep(0.05)
        assert gone(harbor) and gone(sleeper), "Harbor's process group outlived the eval"
        assert f"{signal.Signals(sig).name}: stopping (1 Harbor process group(s) ended)" in err, err
        assert json.loads(out.splitlines()[-1])["errors"][0]["error"] == "cancelled"
    finally:
        if p.poll() is None:
            p.kill()
        for f in ("harbor.pid", "child.pid"):
            if (tmp_path / f).exists():
                pid = int((tmp_path / f).read_text())
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)
    assert stat.S_ISDIR(os.stat(tmp_path).st_mode)
