"""The PPO step is free of machinery: `import ppo` loads the paper's modules it uses (critic, r3, tito, the run
directory, the data-parallel sums) and nothing of the engine, the sandbox, the cluster backends, the task
families, the experiments, the trainer process, the rollout harness or the loop. Checked in a fresh interpreter
(the test process itself has imported everything)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "sandbox", "cluster", "tasks", "experiments")  # the machinery, by what it is
NOT_BELOW_PPO = ("trainer", "rollout", "train_t1")  # the process that calls ppo, the harness, the loop
MOST_MODULES = 8  # ppo, critic, r3, tito, chat_tokens, rundir, dp: seven, and one to spare

PROBE = """
import json, sys
from pathlib import Path
import ppo
root = Path.cwd()
project = {p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in project)))
"""


def test_import_ppo_loads_no_machinery():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"import ppo loads {len(loaded)} project modules: {', '.join(loaded)}")
    machinery = [m for m in loaded if m.split(".")[0] in PACKAGES or m in NOT_BELOW_PPO]
    assert not machinery, f"import ppo loads machinery: {machinery}"
    assert len(loaded) <= MOST_MODULES, f"import ppo loads {len(loaded)} project modules: {loaded}"
