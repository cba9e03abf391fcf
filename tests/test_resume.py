"""A run killed with SIGKILL in the middle of an RL step resumes to the same step count with nothing lost
or duplicated: every step's metrics and samples exist exactly once, and the killed step is redone."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--quick", "--n-train-tasks", "8", "--n-heldout-tasks", "3", "--n-launch", "5", "--n-keep", "4",
        "--critic-warmup-trials", "4", "--sft-epochs", "1", "--max-turns", "3", "--max-new-tokens", "48",
        "--rollout-workers", "5", "--minibatch-size", "2", "--rl-steps", "3", "--eval-train-tasks", "2"]


def run(run_dir, kill_at=None, timeout=600):
    proc = subprocess.Popen([sys.executable, "train_t1.py", "--run-dir", str(run_dir)] + TINY, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        log = (run_dir / "log.txt").read_text() if (run_dir / "log.txt").exists() else ""
        if kill_at and kill_at in log:
            os.kill(proc.pid, signal.SIGKILL)  # the trainer only: the engine and sandboxes must die with it
            proc.wait()
            return log
        time.sleep(0.2)
    assert proc.wait(timeout=max(1, timeout - (time.time() - t0))) == 0
    return (run_dir / "log.txt").read_text()


def test_kill_mid_update_then_resume_loses_and_repeats_nothing(tmp_path):
    run_dir = tmp_path / "run"
    log = run(run_dir, kill_at="step 2: actor update")  # killed inside step 2's PPO update
    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == 1  # step 2 never checkpointed
    # the Ray actors (trainer, engine, rollout workers) and their sandboxes die with the killed driver
    pids = [int(p) for p in re.findall(r"pid'?:? (\d+)", log.split("ray actors:")[1].splitlines()[0])]
    pids += [int(p) for p in re.findall(r"\[([\d, ]+)\]", log.split("rollout workers pids")[1])[0].split(",")]
    assert len(pids) >= 4
    deadline = time.time() + 30
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.5)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "an actor outlived the killed driver"
    jails = subprocess.run(["pgrep", "-f", f"bwrap.*{run_dir}"], capture_output=True)
    assert jails.returncode == 1, "a sandbox outlived the killed driver"
    run(run_dir)
    rl = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if json.loads(l)["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert json.loads((run_dir / "state.json").read_text())["step"] == 3
    assert sorted(p.name for p in (run_dir / "samples").glob("*.jsonl")) == [f"step_{i:06d}.jsonl" for i in (1, 2, 3)]
    log = (run_dir / "log.txt").read_text()
    assert "resumed at RL step 1" in log
    assert log.count("step 2: critic update") == 2  # the killed step was redone once, from its start
