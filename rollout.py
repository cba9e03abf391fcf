"""Rollout: one trial (sandbox, agent, verifier), oversampling over many, the evaluation protocol.

Paper section "rollout" (T1, arXiv 2609.11042): the agent speaks the Terminus-2 protocol (terminus2.py: one JSON reply
per turn, keystrokes to a real shell, `task_complete` confirmed on a second turn) in a sandbox; when the agent stops
(or a limit hits) the task's tests are copied in and its own verifier scores it (reward.py: r = P/S). One trajectory
per task; a step launches 560 tasks and keeps the first 512 that finish, the rest are cancelled (run_trials, on Ray:
ray_run_trials). The conversation is token-first (TITO, terminus2.TokenChat): the loss tokens are exactly the sampled
ones. The sandbox is sandbox.jail.Sandbox (the local bubblewrap jail; its security policy is listed in
sandbox/jail.py) or sandbox.daytona.DaytonaSandbox (sandbox="daytona"), behind one interface. The engine is reached
through engine/client.py's EngineClient (SGLang's protocol, served by engine/server.py too).
The evaluation protocol (EVAL, evaluate_trials): the paper's limits and sampling, every (task, attempt) one trial in
the denominator; train_t1 runs it with this harness, `python -m engine.gateway eval` with Harbor's Terminus-2.

Run:
    python rollout.py --task DIR --agent oracle|nop|model|scripted [--engine-url URL] [--model-path DIR]
                      [--sandbox bwrap|daytona] [--reward-scale S] [--keep DIR]
    # prints one JSON line: reward, reward_scale, resolved, passed, total, reward_source, reward_reason, turns,
    # exit_reason, exit_detail, oracle_exit, error, wall_s, trial_dir (--keep: with host/agent_transcript.jsonl);
    # exit status 1 when nothing was scored (exit_reason "error" / "cancelled": an unloadable --model-path, an
    # oracle run of a task without solution/solve.sh, ...), 2 on bad flags
In code: run_trial(task_dir, agent, ...) -> dict; run_trials(task_dirs, agent, n_keep=...) -> (kept, dropped);
run_text_trial (the same loop as text through the OpenAI gateway); evaluate_trials(task_dirs, run_attempt, attempts).
Steps of train_t1's RL loop: to_samples (trials -> TITO samples), audit_samples (the step's TITO / R3 audit).

Departures from the paper / Terminus-2 (the harness's: terminus2.py; the sandbox's: sandbox/jail.py):
1. Oversampling counts a trial as "finished" when it ended without a crash; crashed and cancelled
   trials go to `dropped` with their reason and seconds run.
2. With sandbox "bwrap", a task that needs its image built (task_io.image_needs) is refused at the start of run_trial
   (exit_reason "error", "needs its image: use --sandbox daytona or Harbor's docker environment", the reasons):
   run here it would fail for want of a tool and score 0 silently.
"""
import argparse
import concurrent.futures as cf
import itertools
import json
import math
import os
import random
import stat
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import reward  # standard library only: the --reward-scale default


def build_parser() -> argparse.ArgumentParser:
    """The command line of one trial (standard library only: --help answers before torch loads)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", required=True, help="a Harbor / Terminal-Bench 2 task directory")
    p.add_argument("--agent", required=True, choices=["oracle", "nop", "model", "scripted"],
                   help="oracle: the task's solution/solve.sh; nop: nothing; model: the engine's replies; "
                        "scripted: the replies of solution/terminus2.json")
    p.add_argument("--engine-url", default=None, help="SGLang-protocol engine (agent model), e.g. engine/server.py's")
    p.add_argument("--model-path", default=None, help="directory with the tokenizer (model/scripted agents)")
    p.add_argument("--sandbox", default="bwrap", choices=["bwrap", "daytona"],
                   help="bwrap: the local jail (root); daytona: the task's image on Daytona (DAYTONA_API_KEY)")
    p.add_argument("--reward-scale", type=float, default=float(reward.SCALE), metavar="S",
                   help="S of r = P / S (the paper's; the number of tests gives a pass rate)")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="keep the trial directory (app/, logs/ with the agent's and the verifier's output, host/ with "
                        "the host's logs and the agent's transcript host/agent_transcript.jsonl) under DIR")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, parsed and checked (standard library only): bad flags exit 2 before torch loads."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.keep and os.path.exists(a.keep) and not os.path.isdir(a.keep):
        p.error(f"--keep: {a.keep} exists and is not a directory")
    if a.agent in ("model", "scripted") and not a.model_path:
        p.error(f"--agent {a.agent} needs --model-path (the tokenizer)")
    if a.agent == "model" and not a.engine_url:
        p.error("--agent model needs --engine-url")
    if not (math.isfinite(a.reward_scale) and a.reward_scale > 0):
        p.error(f"--reward-scale: must be a positive finite number, got {a.reward_scale}")
    return a


if __name__ == "__main__":
    ARGV = parse_args()  # --help and bad flags answer here, before torch loads

import infra  # noqa: E402
import r3  # noqa: E402
import terminus2  # noqa: E402
import tito  # noqa: E402
from chat_tokens import IM_END  # noqa: E402
from engine.client import CallInterrupted, EngineClient  # noqa: E402
from sandbox import task_io  # noqa: E402
from sandbox.daytona import DaytonaSandbox  # noqa: E402
from sandbox.host_fs import remove_tree, write_host_file  # noqa: E402
from sandbox.jail import Sandbox  # noqa: E402
from sandbox.limits import make_limits  # noqa: E402


# --- the agents: a policy gives each turn's output ids ------------------------------------------------------
def _scripted_policy(task, tok, faults=0.0, seed=0):
    """Replies of solution/terminus2.json as a policy; a str entry is replayed verbatim (raw text), an
    {"unscored": text} entry too, its record marked unscored (to_samples gives it no loss). faults: with_faults'
    rate, drawn per task and seed (train_t1 --sft-faults: the SFT data's recoveries)."""
    path = os.path.join(task.solution_dir or "", "terminus2.json")
    if not os.path.isfile(path):
        raise ValueError(f"scripted agent: {path} not found")
    with open(path) as f:
        replies = json.load(f)
    if not isinstance(replies, list) or not replies:
        raise ValueError(f"{path}: expected a non-empty JSON list of replies")
    if faults:
        replies = terminus2.with_faults(replies, faults, random.Random(f"{task.name}:{seed}"))
    it = iter(replies)
    im_end = tok.convert_tokens_to_ids(IM_END)

    def policy(prompt_ids, max_new, rid):
        reply = next(it, None)
        if reply is None:
            raise RuntimeError(f"{path}: replies ran out before task_complete was confirmed")
        unscored = isinstance(reply, dict) and set(reply) == {"unscored"}
        reply = reply["unscored"] if unscored else reply
        text = reply if isinstance(reply, str) else json.dumps(reply)
        ids = terminus2.literal_ids(tok, text) + [im_end]  # a reply's text is text: "<|im_end|>" in it is no
        # control token
        fin = "stop" if len(ids) <= max_new else "length"  # a long reply is cut like the engine would
        return {"output_ids": ids[:max_new], "logprobs": None, "routed_experts": None, "finish_reason": fin,
                "weight_version": None, **({"unscored": True} if unscored else {})}
    return policy


def _model_policy(engine_url, tok, sampling, stop_event, deadline=None):
    """The engine as a policy. Each request ends at the trial's deadline or its cancellation (its connection is shut,
    CallInterrupted), whichever is first, and /abort_request is sent for it (best effort, off the trial's thread)."""
    if engine_url is None:
        raise ValueError("engine_url: required for agent 'model'")
    client = EngineClient(engine_url)
    params = {**terminus2.SAMPLING, **(sampling or {})}
    params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) | {tok.convert_tokens_to_ids(IM_END)})

    def abort_quietly(rid):
        try:
            client.abort(rid)
        except Exception:
            pass  # the engine may be gone or hung; the closed connection already tells it

    def policy(prompt_ids, room, rid):
        try:
            return client.generate(prompt_ids, {**params, "max_new_tokens": min(params["max_new_tokens"], room)},
                                   rid=rid, deadline=deadline, stop_event=stop_event)
        except CallInterrupted:
            threading.Thread(target=abort_quietly, args=(rid,), daemon=True).start()
            raise
    return policy


# --- one trial -------------------------------------------------------------------------------------------
def check_runs_here(task) -> None:
    """Refuse up front a task the local jail cannot run (task_io.image_needs): here it would fail for want of a tool
    and score 0 silently."""
    needs = task_io.image_needs(task)
    if needs:
        raise ValueError(f"{task.path}: needs its image: use --sandbox daytona or Harbor's docker environment "
                         f"({'; '.join(needs)})")


def check_has_solution(task) -> None:
    """Refuse agent "oracle" up front for a task without a regular solution/solve.sh: run anyway it exits 127 and
    scores 0 with no error."""
    solve = os.path.join(task.solution_dir or os.path.join(task.path, "solution"), "solve.sh")
    try:
        st = os.lstat(solve)
    except OSError:
        st = None
    if task.solution_dir is None or st is None:
        raise ValueError(f"{task.path}: agent oracle: the task has no solution/solve.sh (nothing to run)")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{task.path}: agent oracle: solution/solve.sh is not a regular file")


def score(box, result: dict, reward_scale=None) -> None:
    """Run the verifier (its own jail), and put r = P/S (S = reward_scale, None: reward.SCALE) and its report
    into `result` (with the S it used)."""
    v = box.run_verifier(reward.SCALE if reward_scale is None else reward_scale)
    result.update(reward=v["reward"], passed=v["passed"], total=v["total"], reward_source=v["source"],
                  resolved=reward.is_resolved(v), reward_scale=reward.SCALE if reward_scale is None else reward_scale)
    result["reward_reason"] = v.get("reason")  # why the CTRF report was not used (None when it was)


def run_trial(task_dir, agent, *, engine_url=None, tokenizer=None, sampling=None, limits=None,
              work_root=None, stop_event=None, sandbox="bwrap", reward_scale=None, chat=None, script_faults=0.0,
              seed=0) -> dict:
    """One trial (sandbox, agent, verifier) with this agent loop; never raises: a crash returns exit_reason
    'error'. The text and Harbor Terminus-2 harnesses: run_text_trial / sandbox.harbor_run.run_harbor_trial (same
    result).

    limits: Limits or a dict of overrides. sampling: SGLang sampling_params (max_new_tokens is clipped to
    the token budget left; <|im_end|> is always a stop token). work_root: trial dirs (app, logs) are kept
    there; None -> a temp dir that is deleted. sandbox: "bwrap" (the local jail, Sandbox) | "daytona"
    (sandbox.daytona.DaytonaSandbox, the cluster's; same interface). reward_scale: S in r = P / S (train_t1's
    --reward-scale; None: reward.SCALE, the paper's 20). chat: agent "model"'s side of the conversation when it
    is not token-first (terminus2.TextChat; then no engine_url / tokenizer here); None: terminus2.TokenChat.
    script_faults, seed: agent "scripted" only: terminus2.with_faults' rate, drawn per task and seed.
    The agent's deadline (min of trial_timeout_s and the agent timeout) holds during a model call too: the request
    is cut there (exit_reason "timeout", exit_detail says so). With work_root, host/agent_transcript.jsonl keeps
    each turn's user message and reply text ({"turn", "user", "reply"}), in the host's folder the agent cannot write.
    """
    t0, stop_event = time.time(), stop_event or threading.Event()
    result = {"task": os.path.basename(os.path.abspath(str(task_dir))), "reward": 0.0, "resolved": False,
              "passed": 0, "total": 0, "reward_source": "none", "reward_reason": None, "turns": 0,
              "invalid_replies": 0, "exit_reason": "error", "exit_detail": None, "error": None, "wall_s": 0.0,
              "weight_versions": [], "records": []}
    root, box, transcript = None, None, None
    try:
        task = task_io.load_task(task_dir)
        result["task"] = task.name
        if agent not in ("oracle", "nop", "model", "scripted"):
            raise ValueError(f"agent: expected oracle|nop|model|scripted, got {agent!r}")
        if sandbox not in ("bwrap", "daytona"):
            raise ValueError(f"sandbox: expected bwrap|daytona, got {sandbox!r}")
        if chat is not None and agent != "model":
            raise ValueError(f"chat: only for agent 'model', got {agent!r}")
        if script_faults and agent != "scripted" or not 0.0 <= script_faults <= 1.0:
            raise ValueError(f"script_faults: a rate in [0, 1] for agent 'scripted', got {script_faults!r} "
                             f"for agent {agent!r}")
        if agent in ("model", "scripted") and tokenizer is None and chat is None:
            raise ValueError(f"tokenizer: required for agent {agent!r}")
        if reward_scale is not None and (isinstance(reward_scale, bool) or not isinstance(reward_scale, (int, float))
                                         or not (math.isfinite(reward_scale) and reward_scale > 0)):
            raise ValueError(f"reward_scale: S of r = P / S must be a positive finite number, got {reward_scale!r}")
        if agent == "oracle":
            check_has_solution(task)
        if sandbox == "bwrap":
            check_runs_here(task)
        limits = make_limits(limits)
        agent_timeout = limits.agent_timeout_s or float(task.config.get("agent", {}).get("timeout_sec",
                                                                                       limits.trial_timeout_s))
        t_end = t0 + min(limits.trial_timeout_s, agent_timeout)
        if work_root is not None:
            os.makedirs(work_root, exist_ok=True)
        root = tempfile.mkdtemp(prefix=f"{task.name}-", dir=work_root)
        if work_root is not None:
            result["trial_dir"] = root  # kept: app/, logs/ (agent, verifier), verifier_output.txt
        box_cls = DaytonaSandbox if sandbox == "daytona" else Sandbox
        box = box_cls(task, root, limits, stop_event=stop_event, solution=(agent == "oracle")).start()
        if agent == "oracle":
            rc, out = box.exec("bash /solution/solve.sh", timeout=max(t_end - time.time(), 1))
            write_host_file(os.path.join(box.host_dir, "oracle.txt"), f"[exit {rc}]\n{out}")  # a dir the agent
            # cannot write (DaytonaSandbox: its local logs dir), never through a link
            result["oracle_exit"] = rc
            exit_reason = "cancelled" if stop_event.is_set() else "oracle"
        elif agent == "nop":
            exit_reason = "nop"
        else:
            if chat is None:
                policy = (_scripted_policy(task, tokenizer, script_faults, seed) if agent == "scripted" else
                          _model_policy(engine_url, tokenizer, sampling, stop_event, t_end))
                chat = terminus2.TokenChat(policy, tokenizer, limits.max_total_tokens, result, deadline=t_end)
            chat.deadline = t_end  # the contract of a chat: reply() does not run past it (TokenChat cuts the call)
            if work_root is not None:
                transcript = terminus2.Transcript(box.host_dir, result)
            exit_reason = terminus2.agent_loop(box, task, chat, limits, stop_event, t_end, result, transcript,
                                               settle=agent == "scripted")  # the expert's outputs complete
        result["exit_reason"], result["turns"] = exit_reason, len(result["records"])
        if exit_reason != "cancelled":
            score(box, result, reward_scale)
            if stop_event.is_set():  # cancelled while verifying: the report may be partial
                result["exit_reason"] = "cancelled"
    except Exception as e:  # a crash inside a trial never propagates
        result.update(exit_reason="error", error=f"{type(e).__name__}: {e}", turns=len(result["records"]))
    finally:
        if transcript is not None:
            transcript.close()  # before the box: close() copies host/ out of its tmpfs
        if box is not None:
            box.close()
        if root is not None and work_root is None:
            err = remove_tree(root)
            if err:
                print(f"[run_trial] {err}", file=sys.stderr)
        result["wall_s"] = time.time() - t0
    return result


def run_text_trial(task_dir, gateway_url, session_id, *, sampling=None, limits=None, work_root=None,
                   stop_event=None, reward_scale=None) -> dict:
    """run_trial with the agent talking text to the OpenAI gateway at gateway_url (terminus2.TextChat); its records
    stay in the gateway under session_id (engine.gateway.Gateway.pop). reward_scale: S of r = P/S (None ->
    reward.SCALE)."""
    res = run_trial(task_dir, "model", limits=limits, work_root=work_root, stop_event=stop_event,
                    reward_scale=reward_scale, chat=terminus2.TextChat(gateway_url, session_id, sampling))
    return {**res, "session_id": session_id}


# --- oversampling: keep the first n_keep that finish (locally, or on the Ray rollout workers) ---------------
def run_trials(task_dirs, agent, n_keep=None, max_workers=8, desc="rollout", submit=None, cancel=None, **kw):
    """Concurrent trials; keep the first n_keep that finish, cancel the rest -> (kept, dropped).

    Paper: launch 560, keep the first 512 finished. dropped: {task, seconds, reason} for cancelled,
    never-started and crashed trials. kw go to run_trial (engine_url, tokenizer, sampling, limits, work_root,
    sandbox). submit(task_dir) -> Future of run_trial's result (or None when cancelled before it started)
    and cancel() replace the local thread pool: ray_run_trials passes its Ray actors' here.
    """
    from tqdm import tqdm
    task_dirs = [str(t) for t in task_dirs]
    n_keep = len(task_dirs) if n_keep is None else n_keep
    if n_keep < 0:
        raise ValueError(f"n_keep: must be >= 0, got {n_keep}")
    stop_event, lock, t0 = threading.Event(), threading.Lock(), time.time()
    kept, dropped, n_tokens = [], [], 0

    def one(td):
        with lock:
            if stop_event.is_set():
                return None
        return run_trial(td, agent, stop_event=stop_event, **kw)

    pool = None
    if submit is None:
        pool = cf.ThreadPoolExecutor(max_workers=max(1, max_workers))
        submit = lambda td: pool.submit(one, td)  # noqa: E731
    bar = tqdm(total=n_keep, desc=desc, leave=False, disable=n_keep == 0)
    try:
        futures = {submit(td): td for td in task_dirs}
        for fut in cf.as_completed(futures):
            td, res = futures[fut], fut.result()
            if res is None:
                dropped.append({"task": os.path.basename(td), "seconds": 0.0, "reason": "not started"})
                continue
            if res["exit_reason"] in ("error", "cancelled") or len(kept) >= n_keep:
                why = {"error": res["error"], "cancelled": "cancelled"}.get(res["exit_reason"], "finished after n_keep")
                dropped.append({"task": res["task"], "seconds": res["wall_s"], "reason": why})
                continue
            kept.append(res)
            n_tokens += sum(len(r["output_ids"]) for r in res["records"])
            bar.update(1)
            bar.set_postfix(launched=len(futures), tok_s=f"{n_tokens / max(time.time() - t0, 1e-9):.0f}")
            if len(kept) >= n_keep and not stop_event.is_set():
                stop_event.set()  # cancel the rest: their sandboxes are killed, their requests aborted
                if cancel is not None:
                    cancel()
    finally:  # on an exception too: nothing keeps running behind the caller's back
        if not stop_event.is_set():
            stop_event.set()
            if cancel is not None:
                cancel()
        if pool is not None:
            pool.shutdown(wait=True)
        bar.close()
    return kept, dropped


class RolloutWorker:
    """Runs trials (run_trial) for the driver's oversampling loop; `slots` of them at once.

    Trials run in the "trials" concurrency group (threads, at most `slots`), cancel() in "control", so a
    cancel is never queued behind trials. Every launch is a round with its own stop event: cancelling a
    round kills its sandboxes, aborts its engine requests and turns its unstarted trials into None.
    """

    def __init__(self, tokenizer_path: str | None = None, cores=None):
        if cores:  # --pin-cores: the rollout side's half of the cores (its jails inherit it)
            infra.pin(cores)
        self.tokenizer, self.rounds, self.lock = None, {}, threading.Lock()
        if tokenizer_path:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def _event(self, rnd):
        with self.lock:
            return self.rounds.setdefault(rnd, threading.Event())

    def trial(self, rnd: str, task_dir: str, agent: str, kw: dict):
        stop = self._event(rnd)
        if stop.is_set():
            return None
        return run_trial(task_dir, agent, stop_event=stop, tokenizer=self.tokenizer, **kw)

    def cancel(self, rnd: str) -> None:
        self._event(rnd).set()

    def pid(self) -> int:
        return os.getpid()


def ray_rollout_workers(n: int, slots: int, tokenizer_path: str | None, placement: list, cores=None):
    """Start n RolloutWorker actors, `slots` concurrent trials each (pinned to `cores` if given) -> actor handles."""
    import ray
    cls = ray.remote(concurrency_groups={"trials": max(1, slots), "control": 2})(RolloutWorker)
    return [cls.options(**placement[i % len(placement)]).remote(tokenizer_path, cores) for i in range(n)]


def ray_run_trials(workers, task_dirs, agent, n_keep=None, engine_urls=None, desc="rollout", **kw):
    """run_trials with its trials on the Ray rollout workers -> (kept, dropped).

    Trials go round robin over the workers and over the engines (engine_urls); kw go to run_trial.
    """
    rnd, it, urls = uuid.uuid4().hex, itertools.count(), list(engine_urls or [None])

    def submit(td):
        i = next(it)
        w, url = workers[i % len(workers)], urls[i % len(urls)]
        ref = w.trial.options(concurrency_group="trials").remote(rnd, str(td), agent, {**kw, "engine_url": url})
        return ref.future()

    def cancel():  # the round's event stays set: a trial still queued for it returns None
        for w in workers:
            w.cancel.options(concurrency_group="control").remote(rnd)
    return run_trials(task_dirs, agent, n_keep=n_keep, desc=desc, submit=submit, cancel=cancel)


# --- steps of the RL loop: trials -> samples, the step's audit ---------------------------------------------
def to_samples(trials: list[dict], run_dir: Path, tag: str, replay: bool = False) -> list[dict]:
    """TITO assembly; a trial that cannot be assembled is recorded with its reason and skipped, except under R3
    replay, where a turn without its routing capture (tito.CaptureError) or a placeholder routing row that feeds
    a trained token (r3.check_capture) aborts the step: never silently dropped (paper, R3). A scripted fault
    turn (with_faults) stays in the context with m = 0 on its tokens (sample["unscored_turns"])."""
    samples = []
    for t in trials:
        if not t.get("records"):
            continue
        try:
            s = tito.assemble(t, replay=replay)
        except tito.CaptureError:
            raise
        except ValueError as e:
            with open(run_dir / "failed_trials.jsonl", "a") as f:
                f.write(json.dumps({"tag": tag, "task": t.get("task"), "reason": str(e)}) + "\n")
            continue
        if s["routed_experts"] is not None:
            try:
                s["placeholder_rows"] = r3.check_capture(s["routed_experts"], s["loss_mask"])
            except ValueError as e:
                if replay:
                    raise ValueError(f"trial {s['task']!r}: {e}") from None
                s["routed_experts"] = None  # R3 off: routing only feeds the expert_set_mismatch figure
        unscored = [i for i, r in enumerate(t["records"]) if r.get("unscored")]
        for i in unscored:  # a scripted fault turn (with_faults): in the context, never trained on
            a, b = s["spans"][i]
            s["loss_mask"][a:b] = 0
        if unscored:
            s["unscored_turns"] = unscored
        samples.append(s)
    return samples


def after_faults(samples: list[dict]) -> list[dict]:
    """Samples with a fault turn (to_samples' "unscored_turns") trained only after their last fault: m = 0 on
    everything before it (the clean replay of the same task already trains that part); the others are left out."""
    out = []
    for s in samples:
        if s.get("unscored_turns"):
            s["loss_mask"][:s["spans"][max(s["unscored_turns"])][1]] = 0
            out.append(s)
    return out


def audit_samples(samples: list[dict], step: int) -> dict:
    """The step's TITO audit (a drifted loss-region token aborts the step) and R3 placeholder fraction."""
    rep = tito.audit(samples)
    if rep["drifted_tokens"]:
        raise RuntimeError(f"step {step}: TITO audit: {rep['drifted_tokens']} of {rep['loss_tokens']} loss-region "
                           f"tokens are not the sampled ids (first {rep['drift'][:3]}); `python tito.py audit` on "
                           f"samples/step_{step:06d}.jsonl lists them")
    rows = sum(len(s["tokens"]) - 1 for s in samples if s.get("routed_experts") is not None)
    return {"tito_drift_pct": rep["loss_region_drift_pct"], "tito_relocation_failures": rep["relocation_failures"],
            "r3_placeholder_frac": sum(s.get("placeholder_rows", 0) for s in samples) / rows if rows else float("nan")}


# --- the evaluation protocol: train_t1's evaluations and `python -m engine.gateway eval` ----------------------
# The paper's evaluation protocol, the one source of it (train_t1.Args' eval_* defaults read it):
# "评测协议（Terminus-2，60 轮/3600s agent/900s verifier，温度 0.1、top-p 0.95、3 次尝试）"
# = Terminus-2, 60 turns, 3600 s agent / 900 s verifier (overriding the tasks' own timeouts), temperature 0.1,
# top-p 0.95, 3 attempts.
EVAL = {"harness": "terminus-2", "max_turns": 60, "agent_timeout_s": 3600.0, "verifier_timeout_s": 900.0,
        "temperature": 0.1, "top_p": 0.95, "attempts": 3}


def trial_failed(t: dict) -> bool:
    """A trial that never reached a verdict: it crashed, was cancelled, or never started."""
    return t.get("exit_reason") in ("error", "cancelled", None)


def evaluate_trials(task_dirs, run_attempt, attempts: int) -> dict:
    """Every (task, attempt) is one trial in the denominator, n_trials = tasks x attempts: a trial that errored,
    was cancelled or never came back counts as reward 0, unresolved, and is listed in `errors` with its reason.

    run_attempt(task_dirs, k) -> the trial results of attempt k (dicts with task, reward, resolved, turns,
    exit_reason, error, as rollout.run_trial returns them), at most one per task dir, in any order; a task is
    matched by its directory's name. Returns solve_rate (resolved: passed == total > 0), reward_mean (r = P/S),
    turns_mean over all n_trials, n_errors, errors [{task, attempt, error}] and trials (one line each)."""
    if attempts < 1:
        raise ValueError(f"evaluation attempts: must be >= 1, got {attempts}")
    names = [os.path.basename(os.path.abspath(str(td))) for td in task_dirs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"evaluation tasks: two task dirs share a name ({dup})")
    trials = []
    for k in range(attempts):
        got = {}
        for t in run_attempt(list(task_dirs), k):
            if t.get("task") not in names or t["task"] in got:
                raise ValueError(f"evaluation attempt {k}: result for task {t.get('task')!r} is "
                                 f"{'a duplicate' if t.get('task') in got else 'not one of the tasks'}")
            got[t["task"]] = t
        for name in names:
            t = got.get(name, {"task": name, "exit_reason": None, "error": "no result came back"})
            failed = trial_failed(t)
            if not failed and not math.isfinite(float(t["reward"])):
                raise ValueError(f"evaluation attempt {k}: task {name!r} has a non-finite reward {t['reward']!r}")
            trials.append({"task": name, "attempt": k, "reward": 0.0 if failed else float(t["reward"]),
                           "resolved": False if failed else bool(t["resolved"]),
                           "turns": int(t.get("turns", 0)), "exit_reason": t.get("exit_reason"),
                           "error": (t.get("error") or t.get("exit_reason")) if failed else t.get("error")})
    n = len(trials)
    assert n == len(names) * attempts, f"evaluation: {n} trials for {len(names)} tasks x {attempts} attempts"
    errors = [{"task": t["task"], "attempt": t["attempt"], "error": t["error"]} for t in trials
              if trial_failed(t)]
    return {"n_tasks": len(names), "attempts": attempts, "n_trials": n, "n_errors": len(errors),
            "solve_rate": sum(t["resolved"] for t in trials) / n if n else 0.0,
            "reward_mean": sum(t["reward"] for t in trials) / n if n else 0.0,
            "turns_mean": sum(t["turns"] for t in trials) / n if n else 0.0, "errors": errors, "trials": trials}


# --- the command line ------------------------------------------------------------------------------------
CLI_FIELDS = ("task", "reward", "reward_scale", "resolved", "passed", "total", "reward_source", "reward_reason",
              "turns", "exit_reason", "exit_detail", "oracle_exit", "error", "wall_s", "trial_dir")


def _load_tokenizer(path):
    """-> (tokenizer, None) or (None, one line saying why --model-path cannot give one). A local directory only:
    a missing path is named, never looked up on the Hugging Face Hub as a repo id."""
    if not os.path.isdir(path):
        return None, (f"--model-path {path}: no such directory (a checkpoint with its tokenizer, e.g. "
                      f"runs/embedded/ckpt/sft)" if not os.path.exists(path) else
                      f"--model-path {path}: not a directory (a checkpoint with its tokenizer)")
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path, local_files_only=True), None
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return None, f"--model-path {path}: cannot load a tokenizer from it ({type(e).__name__}: {first})"


def main(argv=None) -> int:
    """One trial from the command line; prints one JSON line -> exit status 0 (the trial ran and was scored,
    whatever its reward), 1 (nothing was scored: exit_reason "error" or "cancelled", the JSON's "error" says why,
    also on stderr; a --model-path that gives no tokenizer, an oracle run of a task without a solution), 2 (bad
    flags)."""
    a = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    tok, why = _load_tokenizer(a.model_path) if a.model_path else (None, None)
    if why:
        res = {"task": os.path.basename(os.path.abspath(a.task)), "reward": 0.0, "reward_scale": a.reward_scale,
               "resolved": False, "passed": 0, "total": 0, "reward_source": "none", "turns": 0,
               "exit_reason": "error", "error": why, "wall_s": 0.0}
    else:
        res = run_trial(a.task, a.agent, engine_url=a.engine_url, tokenizer=tok, sandbox=a.sandbox, work_root=a.keep,
                        reward_scale=a.reward_scale)
    print(json.dumps({k: res.get(k) for k in CLI_FIELDS}), flush=True)
    if res.get("trial_dir"):
        print(f"trial directory kept: {res['trial_dir']}", file=sys.stderr)
    if res["exit_reason"] in ("error", "cancelled"):
        print(f"error: {res['error'] or 'the trial was ' + res['exit_reason']}", file=sys.stderr)
        return 1
    if a.agent == "oracle" and res.get("oracle_exit"):
        print(f"note: solution/solve.sh exited {res['oracle_exit']} (host/oracle.txt with --keep)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGV))
