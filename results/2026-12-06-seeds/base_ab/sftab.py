"""A/B of the SFT regression: SFT (the run's recipe, its sft.jsonl) from a given base checkpoint, then the
in-template test split of /tmp/full_s1 with the evaluation protocol (3 attempts), through runstate.evaluate."""
import json, subprocess, sys, time, socket, os
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, "/work/main")
import torch
import model as M, ppo, tito, rollout, runstate
from rundir import Metrics

base, out, ref = sys.argv[1], Path(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else "")
run = Path("/tmp/full_s1/runs/full")
a = SimpleNamespace(**json.load(open(run / "args.json")))
out.mkdir(parents=True, exist_ok=True)
ck = out / "sft"
if not (ck / "config.json").exists():
    actor, tok = M.load_actor(base)
    samples = tito.load_samples(run / "samples" / "sft.jsonl")
    t0 = time.time()
    ppo.sft(actor, samples, a, Metrics(out))
    print("sft s", round(time.time() - t0), flush=True)
    runstate.save_dir(actor, tok, ck)
    if ref:
        r, _ = M.load_actor(ref)
        d = max((p - q).abs().max().item() for p, q in zip(actor.state_dict().values(), r.state_dict().values()))
        print("max |w - ref|", d, flush=True)
state = json.load(open(run / "state.json"))
dirs = [run.parent.parent / d for d in state["tasks"]["heldout"]]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
eng = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", str(ck), "--port", str(port)],
                       cwd="/work/main", stdout=subprocess.DEVNULL, stderr=open(out / "engine.log", "w"))
url = f"http://127.0.0.1:{port}"
import urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(url + "/health", timeout=2); break
    except Exception:
        time.sleep(1)
tok, why = rollout._load_tokenizer(str(ck)); assert not why, why
orig = rollout.run_trial
rollout.run_trial = lambda *p, **k: orig(*p, **{**k, "engine_url": url})
try:
    rep = runstate.evaluate(dirs, a, out, tok, None, None, "ab")
finally:
    eng.terminate()
fam = {}
for t in rep["trials"]:
    fam.setdefault(t["task"].split("-")[-1], []).append(t["resolved"])
res = {"base": base, "solve": rep["solve_rate"], "reward": rep["reward_mean"], "n_trials": rep["n_trials"],
       "n_errors": rep["n_errors"], "families": {k: f"{sum(v)}/{len(v)}" for k, v in fam.items()}}
print(json.dumps(res)); (out / "result.json").write_text(json.dumps({**res, "trials": rep["trials"]}))
