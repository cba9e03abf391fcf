"""Cross-evaluation: an SFT checkpoint on another run's test split, one attempt, the eval protocol's sampling/limits."""
import json, subprocess, sys, time, socket, os, collections
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, "/work/main")
from cluster import actors
import rollout


ck, run, split, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
a = SimpleNamespace(**json.load(open(run / "args.json")))
a.rollout_workers = 4
state = json.load(open(run / "state.json"))
dirs = [run.parent.parent / d for d in state["tasks"][split]]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
eng = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", ck, "--port", str(port)],
                       cwd="/work/main", stdout=subprocess.DEVNULL, stderr=open(out + ".engine.log", "w"))
url = f"http://127.0.0.1:{port}"
import urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(url + "/health", timeout=2); break
    except Exception:
        time.sleep(1)
tok, why = rollout._load_tokenizer(ck); assert not why, why
limits = {"max_turns": a.eval_max_turns, "trial_timeout_s": a.eval_agent_timeout_s,
          "agent_timeout_s": a.eval_agent_timeout_s, "verifier_timeout_s": a.eval_verifier_timeout_s}
orig = rollout.run_trial
rollout.run_trial = lambda *p, **k: orig(*p, **{**k, "engine_url": url})
kept, dropped, _ = actors.run_rollouts(dirs, "model", a, Path("/tmp/crosseval_trials"), tok,
                                       temperature=a.eval_temperature, top_p=a.eval_top_p, limits=limits)
eng.terminate()
fam = collections.defaultdict(list)
for t in kept:
    fam[t["task"].split("-")[-1]].append(t["resolved"])
res = {"ck": ck, "split": split, "n": len(dirs), "kept": len(kept), "dropped": len(dropped),
       "solve": sum(t["resolved"] for t in kept) / len(dirs), "reward": sum(t["reward"] for t in kept) / len(dirs),
       "families": {k: f"{sum(v)}/{len(v)}" for k, v in fam.items()}}
print(json.dumps(res)); open(out, "w").write(json.dumps(res))
