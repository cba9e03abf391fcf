"""Evaluate a checkpoint on another run's splits with the run's evaluation protocol (runstate.evaluate: its
attempts, sampling and limits), one engine.server beside it: python evalck.py CKPT RUN_DIR OUT SPLIT [SPLIT ...]
(SPLIT: a runstate.SPLITS name: test, test_deep, test_names, val)."""
import json, subprocess, sys, time, socket
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a clone's root: its code
import rollout, runstate

ck, run, out, names = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
a = SimpleNamespace(**json.load(open(run / "args.json")))
state = json.load(open(run / "state.json"))
out.mkdir(parents=True, exist_ok=True)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
eng = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", ck, "--port", str(port)],
                       stdout=subprocess.DEVNULL, stderr=open(out / "engine.log", "w"))
url = f"http://127.0.0.1:{port}"
import urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(url + "/health", timeout=2); break
    except Exception:
        time.sleep(1)
tok, why = rollout._load_tokenizer(ck); assert not why, why
orig = rollout.run_trial
rollout.run_trial = lambda *p, **k: orig(*p, **{**k, "engine_url": url})
res = {}
try:
    for name, dirs in runstate.split_dirs(state, names).items():
        dirs = [d if Path(d).is_absolute() else str(run.parent.parent / d) for d in dirs]
        rep = runstate.evaluate(dirs, a, out, tok, None, None, name)
        res[name] = rep
        print(name, json.dumps({k: rep[k] for k in ("solve_rate", "reward_mean", "n_trials", "n_errors")}), flush=True)
finally:
    eng.terminate()
(out / "evals.json").write_text(json.dumps({"ckpt": ck, "run": str(run), **res}))
