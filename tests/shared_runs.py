"""Runs shared by several test files, built once per run of the suite: a test module imports the fixture
(`from shared_runs import qwen35_sft  # noqa: F401`) and asks for it by name.

qwen35_sft: the Qwen3.5 SFT checkpoint of the cluster rehearsal (tests/test_cluster.py) and the Megatron end-to-end
run (tests/test_e2e.py), written by `bash run.sh cluster-rehearsal --sft-only` (the rehearsal's own SFT command:
train_t1.py --stop-after sft) at the smallest settings that still give a real checkpoint (no base phase, one SFT
epoch of one step: a plumbing test, quality does not matter). Under xdist the workers share it through the
directory above their own base temp, the first one building it while the others wait on a file lock."""
import fcntl
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
# --backend megatron --plan tp 2: the vocabulary padded for 2 tensor-parallel ranks (the Megatron e2e's plan); the
# rest of the run's flags are SFT-only, the backend's trainer never starts
QWEN35_SFT_FLAGS = ["--quick", "--n-train-tasks", "4", "--n-heldout-tasks", "1", "--validate-train", "false",
                    "--n-sft-tasks", "0", "--base-steps", "0", "--sft-epochs", "1", "--sft-batch-size", "4",
                    "--backend", "megatron", "--plan", '{"tp": 2}']


def shared_dir(tmp_path_factory) -> Path:
    """The directory every xdist worker of this run of the suite sees (one process: its own base temp)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def qwen35_sft(tmp_path_factory):
    """-> (run_dir: the SFT-only run's directory, for T1_REHEARSAL_SFT; ckpt: its ckpt/sft; cmd, stdout: how it was
    built, as run.sh runs it); read only."""
    root = shared_dir(tmp_path_factory)
    run_dir = root / "qwen35_sft"
    cmd = ["bash", "run.sh", "cluster-rehearsal", "--sft-only", *QWEN35_SFT_FLAGS]
    with open(root / "qwen35_sft.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also if this worker dies)
        done = run_dir / "built.json"
        if not done.exists():
            env = dict(os.environ, T1_REHEARSAL_SFT=str(run_dir))
            env.pop("RAY_ADDRESS", None)
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            done.write_text(json.dumps({"cmd": cmd, "stdout": out.stdout[-20000:]}))
    built = json.loads((run_dir / "built.json").read_text())
    return SimpleNamespace(run_dir=run_dir, ckpt=run_dir / "ckpt" / "sft", cmd=built["cmd"], stdout=built["stdout"])
