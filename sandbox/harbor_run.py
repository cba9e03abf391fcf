"""Harbor's stock Terminus-2 through the token gateway: one trial (run_harbor_trial) and the evaluation of a Harbor
dataset with the paper's protocol (evaluate, rollout.EVAL); the main venv's side of the Harbor path.

Paper section "TITO" / evaluation (T1, arXiv 2609.11042): Harbor's agent is a text harness (Terminus-2 over an OpenAI
client); it talks to the model through engine/gateway.py, which records the token ids in rollout.run_trial's record
format (Gateway.pop), so a Harbor trial gives the same result dict as rollout's token-first harness. Harbor runs in
its own venv `.venv-harbor` (Harbor >= 0.25, Python >= 3.12) as a subprocess in its own process group; its
environment is sandbox/harbor_env.py's BwrapEnvironment (the local bubblewrap jail), which that venv imports:
    harbor trial start -c CONFIG.json  # what run_harbor_trial writes (harbor_trial_config) and runs; the trial dir
    # holds verifier/ctrf.json + verifier/reward.txt (read with reward.compute), agent/ (Terminus-2), result.json
Run: `python -m engine.gateway harbor-trial|eval ...` (engine/gateway.py's command line calls this module).

Departures:
1. Harbor's agent runs in the bubblewrap jail (harbor_env.BwrapEnvironment) instead of Docker, and Harbor's verifier
   in the agent's jail: weaker than rollout.py's native path (sandbox/harbor_env.py lists the jail's rules).
2. A task the local jail cannot run (rollout.check_runs_here) is refused before Harbor starts; a trial whose verifier
   never ran (Harbor's environment failed, ...) is an error, never a reward of 0 (harbor_outcome).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import reward
import rollout
import terminus2
from sandbox import task_io
from sandbox.limits import make_limits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
HARBOR_VENV = os.path.join(REPO, ".venv-harbor")


def harbor_python(venv=None):
    return os.path.join(venv or HARBOR_VENV, "bin", "python")


def harbor_available(venv=None) -> str | None:
    """None when Harbor's venv is usable, else the reason it is not."""
    if not os.path.exists(harbor_python(venv)):
        return (f"Harbor's venv is absent ({venv or HARBOR_VENV}; run.sh creates it with Python 3.12 and "
                f"`pip install harbor`)")
    return None


HARBOR_STOP_GRACE_S = 10.0  # a stopped Harbor trial's group gets SIGTERM, then SIGKILL after this (paper silent)
_harbor_groups: set[int] = set()  # process groups of the Harbor trials running now (stop_harbor_groups)
_harbor_lock = threading.RLock()  # re-entrant: the signal handler may run while the main thread holds it


def _end_group(pgid, grace_s):
    """SIGTERM the process group, SIGKILL what is left of it after grace_s (0: at once)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t_end = time.monotonic() + wait
        while time.monotonic() < t_end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def stop_harbor_groups(grace_s=0.0) -> int:
    """End the process group of every Harbor trial this process started and is running (a signal handler calls it:
    Harbor runs in its own session, so nothing else would stop it). -> how many."""
    with _harbor_lock:
        groups = list(_harbor_groups)
    for pgid in groups:
        _end_group(pgid, grace_s)
    return len(groups)


def harbor_outcome(trial_dir) -> str | None:
    """None when Harbor's verifier ran (result.json has a verifier_result), else why the trial has no verdict: Harbor's
    own exception (its environment failed to start, the verifier timed out, ...) or its missing result.json."""
    path = os.path.join(trial_dir, "result.json")
    if not os.path.isfile(path):
        return f"harbor wrote no {path}"
    try:
        res = json.load(open(path))
    except ValueError as e:
        return f"{path}: not JSON ({e})"
    if isinstance(res, dict) and res.get("verifier_result") is not None:
        return None
    exc = (res.get("exception_info") if isinstance(res, dict) else None) or {}
    if exc:
        return f"harbor: {exc.get('exception_type')}: {str(exc.get('exception_message'))[:500]} (no verifier result)"
    return f"harbor: {path} has no verifier result"


def harbor_trial_config(task_dir, trials_dir, trial_name, api_base, *, temperature, top_p, max_new_tokens,
                        max_total_tokens, agent_timeout_s=None, verifier_timeout_s=None, max_turns=None) -> dict:
    """Harbor TrialConfig: stock Terminus-2 against the gateway, summarisation off, bubblewrap environment."""
    kwargs = {"api_base": api_base, "temperature": temperature, "collect_rollout_details": True,
              "session_id": trial_name, "enable_summarize": False, "proactive_summarization_threshold": 0,
              "record_terminal_session": False, "suppress_max_turns_warning": True,
              "model_info": {"max_input_tokens": max_total_tokens, "max_output_tokens": max_new_tokens,
                             "input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
              "llm_call_kwargs": {"top_p": top_p, "max_tokens": max_new_tokens}}
    if max_turns is not None:
        kwargs["max_turns"] = max_turns
    return {"task": {"path": os.path.abspath(task_dir)}, "trial_name": trial_name,
            "trials_dir": os.path.abspath(trials_dir),
            "agent": {"name": "terminus-2", "model_name": "openai/t1", "kwargs": kwargs,
                      **({"override_timeout_sec": agent_timeout_s} if agent_timeout_s else {})},
            "environment": {"import_path": "sandbox.harbor_env:BwrapEnvironment", "delete": True,
                            "kwargs": {"tools_prefix": sys.prefix}},
            "verifier": {**({"override_timeout_sec": verifier_timeout_s} if verifier_timeout_s else {})}}


def run_harbor_trial(task_dir, gateway, *, trials_dir, sampling=None, limits=None, stop_event=None,
                     agent_timeout_s=None, verifier_timeout_s=None, trial_name=None, reward_scale=None,
                     harbor_venv=None) -> dict:
    """One Harbor Terminus-2 trial through `gateway` (a started engine.gateway.Gateway: its url, and pop for the
    records) -> rollout.run_trial's result (records from the gateway).
    reward_scale: S of r = P/S (None -> reward.SCALE). A task the local jail cannot run (rollout.check_runs_here) is
    refused before Harbor starts; a trial whose verifier never ran (Harbor's environment failed, ...) is an error,
    never a reward of 0; stop_event ends Harbor's process group (SIGTERM, SIGKILL after HARBOR_STOP_GRACE_S)."""
    t0, stop_event, limits = time.time(), stop_event or threading.Event(), make_limits(limits)
    sp = {**terminus2.SAMPLING, **(sampling or {})}
    name = trial_name or f"{os.path.basename(os.path.abspath(str(task_dir)))}__{uuid.uuid4().hex[:8]}"
    result = {"task": os.path.basename(os.path.abspath(str(task_dir))), "reward": 0.0, "resolved": False, "passed": 0,
              "total": 0, "reward_source": "none", "turns": 0, "exit_reason": "error", "error": None, "wall_s": 0.0,
              "weight_versions": [], "records": [], "session_id": name, "trial_dir": os.path.join(trials_dir, name)}
    try:
        why = harbor_available(harbor_venv)
        if why:
            raise RuntimeError(why)
        task = task_io.load_task(task_dir)
        rollout.check_runs_here(task)  # BwrapEnvironment is the local jail: the same refusal as rollout.py's
        os.makedirs(trials_dir, exist_ok=True)
        cfg = harbor_trial_config(task_dir, trials_dir, name, gateway.url + "/v1", temperature=sp["temperature"],
                                  top_p=sp["top_p"], max_new_tokens=sp["max_new_tokens"],
                                  max_total_tokens=limits.max_total_tokens, max_turns=limits.max_turns,
                                  agent_timeout_s=agent_timeout_s or limits.trial_timeout_s,
                                  verifier_timeout_s=verifier_timeout_s)
        cfg_path = os.path.join(trials_dir, f"{name}.config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)
        env = {**os.environ, "PYTHONPATH": REPO, "OPENAI_API_KEY": "sk-local", "PYTHONUNBUFFERED": "1"}
        with open(os.path.join(trials_dir, f"{name}.harbor.log"), "w") as log, _harbor_lock:
            if stop_event.is_set():
                result["exit_reason"] = "cancelled"
                return result
            p = subprocess.Popen([os.path.join(harbor_venv or HARBOR_VENV, "bin", "harbor"), "trial", "start", "-c",
                                  cfg_path], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                 start_new_session=True)  # its own process group: stopped as one (_end_group)
            _harbor_groups.add(p.pid)
        try:
            while p.poll() is None and not stop_event.wait(0.2):
                pass
            if stop_event.is_set():
                _end_group(p.pid, HARBOR_STOP_GRACE_S)
                p.wait()
                result["exit_reason"] = "cancelled"
                return result
        finally:
            _end_group(p.pid, 0.0)  # what Harbor left running in its group
            p.wait()
            with _harbor_lock:
                _harbor_groups.discard(p.pid)
        tdir = result["trial_dir"]
        if not os.path.isdir(tdir):
            raise RuntimeError(f"harbor wrote no trial dir {tdir} (rc {p.returncode}; see {log.name})")
        why = harbor_outcome(tdir)
        if why:
            raise RuntimeError(f"{why} (rc {p.returncode}; see {log.name})")
        res = json.load(open(os.path.join(tdir, "result.json")))
        scale = reward.SCALE if reward_scale is None else reward_scale
        # the report files there are copies our BwrapEnvironment.download_dir made (host-owned, no links)
        v = reward.compute(os.path.join(tdir, "verifier"), scale, owner_uid=os.geteuid(),
                           n_assertions=task.n_assertions)
        result.update(reward=v["reward"], passed=v["passed"], total=v["total"], reward_source=v["source"],
                      resolved=reward.is_resolved(v), exit_reason="harbor", reward_scale=scale,
                      error=(res.get("exception_info") or {}).get("exception_message")
                      if res.get("exception_info") else None)
    except Exception as e:
        result.update(exit_reason="error", error=f"{type(e).__name__}: {e}")
    finally:
        trial = gateway.pop(name)
        result["records"], result["turns"] = trial["records"], len(trial["records"])
        result["wall_s"] = time.time() - t0
    return result



# --- evaluation of a Harbor dataset with the paper's protocol (rollout.EVAL, rollout.evaluate_trials) ------------
def dataset_tasks(dataset_dir) -> tuple[list[str], dict[str, str]]:
    """A Harbor dataset dir -> (its task dirs (entries with a task.toml), {task dir: why the local jail cannot run it}),
    the refusals from task_io.load_task and rollout.check_runs_here, made before anything runs.
    ValueError naming the dir when it is not a directory or holds no task dir (an evaluation of nothing)."""
    if not os.path.isdir(dataset_dir):
        raise ValueError(f"dataset: {dataset_dir} is not a directory")
    tasks = sorted(str(p) for p in Path(dataset_dir).iterdir() if (p / "task.toml").is_file())
    if not tasks:
        raise ValueError(f"dataset: {dataset_dir} holds no task dir (an entry with a task.toml): nothing to evaluate")
    refused = {}
    for td in tasks:
        try:
            rollout.check_runs_here(task_io.load_task(td))
        except Exception as e:  # a task that cannot be read is refused too, with its reason
            refused[td] = f"refused before running: {e}"
    return tasks, refused


def evaluate(dataset_dir, gateway, trials_dir, attempts=rollout.EVAL["attempts"], max_total_tokens=8192,
             max_new_tokens=2048, reward_scale=None, stop_event=None, harbor_venv=None) -> dict:
    """Terminus-2 via Harbor with the paper's protocol (rollout.EVAL) on every task dir of a Harbor dataset dir,
    `attempts` per task, through `gateway` (a started engine.gateway.Gateway in tito mode, the caller's to stop) and
    rollout.evaluate_trials (every trial counts). A task the local jail cannot run (dataset_tasks) is not
    started: each of its trials is an error ("refused before running: ..."), listed in `refused`. stop_event: the
    running trial's Harbor is stopped and no further trial starts (those count as errors). ValueError for a dataset
    with no task dir."""
    tasks, refused = dataset_tasks(dataset_dir)
    stop_event, protocol = stop_event or threading.Event(), rollout.EVAL

    def run_attempt(task_dirs, k):
        out = []
        for td in task_dirs:
            name = os.path.basename(td)
            if td in refused:
                out.append({"task": name, "exit_reason": "error", "error": refused[td]})
            elif stop_event.is_set():
                out.append({"task": name, "exit_reason": "cancelled", "error": "the evaluation was stopped"})
            else:
                out.append(run_harbor_trial(
                    td, gateway, trials_dir=trials_dir, trial_name=f"{name}__a{k}", stop_event=stop_event,
                    sampling={"temperature": protocol["temperature"], "top_p": protocol["top_p"],
                              "max_new_tokens": max_new_tokens},
                    limits={"max_total_tokens": max_total_tokens, "max_turns": protocol["max_turns"],
                            "trial_timeout_s": protocol["agent_timeout_s"]},
                    agent_timeout_s=protocol["agent_timeout_s"], verifier_timeout_s=protocol["verifier_timeout_s"],
                    reward_scale=reward_scale, harbor_venv=harbor_venv))
        return out
    rep = rollout.evaluate_trials(tasks, run_attempt, attempts)
    return {**rep, "refused": {os.path.basename(td): why for td, why in refused.items()},
            "protocol": {**protocol, "attempts": attempts}}


def on_signal(stop_event):
    """SIGTERM / SIGINT: stop every Harbor process group this process started (they run in their own sessions, so
    they would outlive it) and let the running command end with the signal's status."""
    got = []

    def handler(signum, frame):
        got.append(signum)
        stop_event.set()
        n = stop_harbor_groups(grace_s=0.0)
        print(f"gateway: {signal.Signals(signum).name}: stopping ({n} Harbor process group(s) ended)", file=sys.stderr,
              flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return got
