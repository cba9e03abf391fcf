"""rollout.py and sandbox/jail.py: real bubblewrap sandboxes, real pytest --ctrf verifiers, the token-first harness."""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import rollout  # noqa: E402
import terminus2  # noqa: E402
from engine.client import EngineClient  # noqa: E402
from sandbox import jail  # noqa: E402
from sandbox import task_io  # noqa: E402
from sandbox.limits import Limits  # noqa: E402

pytestmark = [pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"),
                                 reason="the bubblewrap sandbox needs root and bwrap"),
              pytest.mark.waits]  # terminals and deadlines: mostly waiting (tests/suite_order.py runs these first)
LINES = ["pear", "apple", "fig", "kiwi", "banana"]
TEST_OUTPUTS = '''import os

def test_out_exists():
    assert os.path.isfile("/app/out.txt")

def test_out_sorted():
    assert open("/app/out.txt").read().split() == sorted(open("/app/in.txt").read().split())

def test_out_line_count():
    assert len(open("/app/out.txt").read().splitlines()) == 5
'''
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
SORT = {"analysis": "in.txt is there", "plan": "sort it", "task_complete": False,
        "commands": [{"keystrokes": "sort in.txt > out.txt\n", "duration": 0.5}]}
DONE = {"analysis": "out.txt written", "plan": "done", "commands": [], "task_complete": True}
SCRIPT = ["this is not json", SORT, DONE, {**DONE, "analysis": "checked"}]


def make_task(root, name="sort-lines", script=SCRIPT, solve="sort in.txt > out.txt", agent_timeout=120):
    """A small Harbor-format task: sort /app/in.txt into /app/out.txt; 3 assertions."""
    d = root / name
    for sub in ("environment/app", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text(f'[metadata]\nfamily = "text"\ndifficulty = "easy"\n\n[verifier]\ntimeout_sec = 60\n'
                                 f'\n[agent]\ntimeout_sec = {agent_timeout}\n')
    (d / "instruction.md").write_text("Write the lines of /app/in.txt, sorted, to /app/out.txt.\n")
    (d / "environment/Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY app/ /app/\n")
    (d / "environment/app/in.txt").write_text("\n".join(LINES) + "\n")
    (d / "tests/test.sh").write_text(TEST_SH)
    (d / "tests/test_outputs.py").write_text(TEST_OUTPUTS)
    (d / "solution/solve.sh").write_text(f"#!/bin/bash\ncd /app\n{solve}\n")
    (d / "solution/terminus2.json").write_text(json.dumps(script))
    return d


def cmdline(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def uid_procs(uid):
    """Host pids of processes running as uid."""
    out = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/status") as f:
                if any(ln.startswith("Uid:") and ln.split()[1] == str(uid) for ln in f):
                    out.append(int(p))
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            pass
    return out


@pytest.fixture
def task(tmp_path):
    return make_task(tmp_path)


@pytest.fixture
def box(task, tmp_path):
    limits = Limits(max_procs=32, output_bytes=2000, file_bytes=1 << 20)
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial", limits) as b:
        yield b


@pytest.fixture(scope="module")
def tok():
    return _tok()


def _tok():
    model = pytest.importorskip("model")
    return model.train_tokenizer([json.dumps(r) for r in SCRIPT] + [terminus2.PROMPT, "sort in.txt > out.txt"] * 4,
                                 vocab_size=400)


# --- sandbox --------------------------------------------------------------------------------------

def test_sandbox_has_no_network(box):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        code = ("import socket,sys\nfor a in [('127.0.0.1', %d), ('1.1.1.1', 53)]:\n"
                "    try: socket.create_connection(a, timeout=2); print('CONNECTED', a)\n"
                "    except OSError as e: print('BLOCKED', a, e)\n") % port
        rc, out = box.exec(f"python3 -c \"{code}\"")
        assert "CONNECTED" not in out and out.count("BLOCKED") == 2, out
        rc, out = box.exec("cat /proc/net/dev")
        assert "lo:" in out and "eth" not in out
    finally:
        srv.close()


def test_sandbox_cannot_write_outside_app_logs_tmp(box):
    for path in ("/usr/x", "/etc/x", "/x", "/tests/x", "/root/x", sys.prefix + "/x"):
        rc, out = box.exec(f"echo hi > {path}")
        assert rc != 0, f"could write {path}"
    rc, out = box.exec("echo hi > /app/a && echo hi > /logs/b && echo hi > /tmp/c && id -u && cat /tmp/c")
    assert rc == 0 and out.split() == [str(box.uid), "hi"], out
    assert ((open(os.path.join(box.root, "app", "a")).read(), open(os.path.join(box.root, "logs", "b")).read())
            == ("hi\n",) * 2)


def test_sandbox_hides_host_and_task_tests(box, task):
    rc, out = box.exec(f"ls /work/main/rollout.py /work/shared {task} {task}/tests; ls -A /tests; ls /; ls -A /app")
    assert out.count("No such file") == 4 and "test_outputs.py" not in out and "solution" not in out, out
    assert "in.txt" in out
    rc, out = box.exec("pytest --version")
    assert rc == 0 and "pytest" in out, out


def test_command_timeout_kills_infinite_loop(box):
    t0 = time.time()
    rc, out = box.exec("echo start; while true; do :; done", timeout=1)
    assert rc == 124 and "start" in out and "timed out" in out and time.time() - t0 < 5
    rc, out = box.exec("ps -eo args= | grep -c '[w]hile true' || true")
    assert out.strip() == "0", out  # the loop's process is gone


def test_output_is_capped(box):
    rc, out = box.exec("head -c 1000000 /dev/zero | tr '\\0' a")
    assert rc == 0 and len(out) < 2200 and "truncated" in out
    box.send_keys("head -c 100000 /dev/zero | tr '\\0' b\n")
    text = box.read(2)
    assert len(text) < 2200 and "truncated" in text


def test_a_read_after_keys_waits_for_their_output_not_the_prompt_from_before_them(box):
    """send_keys keeps the shell's first prompt for the next read(); a shell slow to echo the keys (a loaded machine;
    here stopped for 0.5 s) must not have that prompt end the read before the command ran (it did: the read gave
    back "/app$ " alone)."""
    assert box.send_keys("") == 0  # the terminal opens: its first prompt waits in the buffer
    shells = uid_procs(box.uid)
    assert shells
    for pid in shells:
        os.kill(pid, signal.SIGSTOP)
    try:
        box.send_keys("echo mark$((6 * 7))\n")
        with ThreadPoolExecutor(1) as ex:
            reading = ex.submit(box.read, 10)
            time.sleep(0.5)
            assert not reading.done()  # no output since the keys: the old prompt does not end the read
            for pid in shells:
                os.kill(pid, signal.SIGCONT)
            text = reading.result(timeout=20)
    finally:
        for pid in shells:
            os.kill(pid, signal.SIGCONT)
    assert "mark42" in text, text


def test_fork_bomb_is_contained_and_tree_killed_at_close(box):
    box.send_keys(":(){ :|:& };:\n")
    time.sleep(2)
    n = len(uid_procs(box.uid))
    assert 0 < n <= 32, n  # RLIMIT_NPROC of the trial uid
    box.close()
    deadline = time.time() + 5
    while uid_procs(box.uid) and time.time() < deadline:
        time.sleep(0.1)
    assert uid_procs(box.uid) == []


def test_fork_bomb_trial_ends_and_verifier_still_runs(tmp_path):
    bomb = {**SORT, "commands": [{"keystrokes": ":(){ :|:& };:\n", "duration": 1.0}]}
    task = make_task(tmp_path, script=[bomb, SORT, DONE, DONE])
    t0 = time.time()
    res = rollout.run_trial(task, "scripted", tokenizer=_tok(), limits={"max_procs": 32, "max_duration_s": 1.0})
    assert res["exit_reason"] == "task_complete" and res["reward_source"] == "ctrf", res["error"]
    assert time.time() - t0 < 60


def test_close_kills_background_and_setsid_processes(box):
    box.send_keys("setsid sleep 1000 & nohup sleep 1001 &\n")
    box.read(0.5)
    rc, out = box.exec("setsid sleep 1002 > /dev/null 2>&1 & echo started")
    assert "started" in out and len(uid_procs(box.uid)) >= 4
    jail_pid = box.jail.pid
    box.close()
    deadline = time.time() + 5
    while uid_procs(box.uid) and time.time() < deadline:
        time.sleep(0.1)
    assert uid_procs(box.uid) == [] and not os.path.exists(f"/proc/{jail_pid}/status")


ORPHAN = """import os, sys, time
sys.path.insert(0, {root!r})
from sandbox import jail, task_io
from sandbox.limits import Limits
args = jail.Sandbox._bwrap_args  # the race: killed before bwrap's prctl(PR_SET_PDEATHSIG) ran
jail.Sandbox._bwrap_args = lambda self, phase="agent": [a for a in args(self, phase) if a != "--die-with-parent"]
box = jail.Sandbox(task_io.load_task({task!r}), {trial!r}, Limits()).start()
box.send_keys("sleep 1000 &\\n")
box.read(0.5)
print(box.jail.pid, box.uid, flush=True)
time.sleep(1000)
"""


def test_jail_dies_with_its_parent_even_without_the_parent_death_signal(task, tmp_path):
    """A parent SIGKILLed between fork and bwrap's prctl(PR_SET_PDEATHSIG) (a CI run once left a jail behind):
    the jail's lifeline pipe ends it anyway, the agent's processes with it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ORPHAN.format(root=root, task=str(task), trial=str(tmp_path / "trial"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    jail_pid, uid = map(int, proc.stdout.readline().split())
    assert uid_procs(uid) and "--die-with-parent" not in cmdline(jail_pid)
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while (uid_procs(uid) or cmdline(jail_pid)) and time.time() < deadline:
        time.sleep(0.1)
    alive = cmdline(jail_pid)
    if alive:
        os.killpg(jail_pid, signal.SIGKILL)  # no orphan left behind by the failing test itself
    assert uid_procs(uid) == [] and alive == "", "the jail outlived its parent"


def test_terminal_keeps_state_and_ctrl_c_interrupts(box):
    box.send_keys("cd /tmp && export X=41\n")
    box.read(0.5)
    box.send_keys("sleep 100\n")
    box.read(0.3)
    deadline = time.time() + 15  # C-c once sleep runs (launched as `nohup ... &`, sleep ignored SIGINT: the jail)
    while not any(cmdline(p) == "sleep 100" for p in uid_procs(box.uid)) and time.time() < deadline:
        time.sleep(0.05)
    box.send_keys("C-c")
    box.read(0.3)
    box.send_keys("echo $((X+1)) $PWD\n")
    out, deadline = "", time.time() + 15  # a loaded machine can take more than a second to answer
    while "42 /tmp" not in out and time.time() < deadline:
        out += box.read(1)
    assert "42 /tmp" in out, (out, [(p, cmdline(p), sig_fields(p)) for p in uid_procs(box.uid)])  # state kept
    # (cd, export) and the shell back after ctrl-c interrupted sleep 100; on failure: the jail's processes and
    # their ignored / blocked signal masks


def sig_fields(pid) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(ln.strip() for ln in f if ln.startswith(("SigIgn", "SigBlk", "State")))
    except (FileNotFoundError, ProcessLookupError):
        return ""


# --- agents ---------------------------------------------------------------------------------------

def test_oracle_resolves_fixture_task_and_nop_scores_zero(task):
    res = rollout.run_trial(task, "oracle")
    assert res["exit_reason"] == "oracle", res["error"]
    assert (res["passed"], res["total"], res["reward"], res["resolved"]) == (3, 3, 3 / 20, True)  # r = P / S
    assert res["reward_source"] == "ctrf"
    res = rollout.run_trial(task, "nop")
    assert (res["exit_reason"], res["reward"], res["passed"], res["resolved"]) == ("nop", 0.0, 0, False)


def test_verifier_pytest_loads_the_ctrf_reporter_and_no_host_plugin(tmp_path):
    """The verifier's pytest is the host venv's: of its plugins only the CTRF reporter is loaded (sandbox.VERIFIER_ENV),
    not xdist (installed: the suite runs with -n) nor the other auto-loaded ones; the report is still written."""
    import importlib.util
    assert importlib.util.find_spec("xdist") is not None  # else this test would prove nothing
    task = make_task(tmp_path)
    (task / "tests/test_outputs.py").write_text(
        "def test_no_host_plugin(request):\n"
        "    pm = request.config.pluginmanager\n"
        "    assert not pm.has_plugin('xdist') and not pm.has_plugin('xdist.plugin')\n"
        "    assert pm.has_plugin('ctrf.main') or pm.has_plugin('ctrf')\n\n"
        "def test_fails():\n    assert False\n")
    res = rollout.run_trial(task, "oracle")
    assert (res["reward_source"], res["passed"], res["total"]) == ("ctrf", 1, 2), res


def test_crash_inside_trial_is_returned(tmp_path, task):
    res = rollout.run_trial(tmp_path / "missing", "oracle")
    assert res["exit_reason"] == "error" and "does not exist" in res["error"]
    res = rollout.run_trial(task, "model", engine_url="http://127.0.0.1:9", tokenizer=object())
    assert res["exit_reason"] == "error" and res["error"]


def test_parse_reply_names_the_error():
    assert terminus2.parse_reply("hello")[1] == "no JSON object found"
    assert "invalid JSON" in terminus2.parse_reply("{'a': 1}")[1]
    assert "'plan'" in terminus2.parse_reply('{"analysis": "", "commands": []}')[1]
    assert "duration" in terminus2.parse_reply('{"analysis": "", "plan": "", "commands": [{"keystrokes": "ls", '
                                             '"duration": "x"}]}')[1]
    reply, err = terminus2.parse_reply("ok " + json.dumps(SORT) + " trailing")
    assert err is None and reply["commands"][0]["keystrokes"] == "sort in.txt > out.txt\n"


def test_fault_replies_are_refused_or_misspell_the_program():
    """terminus2.fault_reply: the two format faults are refused by the harness, the command fault parses and runs
    one command whose program name is misspelled; with_faults puts one before a reply that does not complete."""
    replies = [SORT, DONE, {**DONE, "analysis": "checked"}]
    for seed in range(50):
        rng = random.Random(seed)
        for kind in ("invalid_json", "no_plan"):
            assert terminus2.parse_reply(terminus2.fault_reply(SORT, kind, rng))[1] is not None
        bad, err = terminus2.parse_reply(terminus2.fault_reply(SORT, "bad_command", rng))
        assert err is None and not bad["task_complete"] and len(bad["commands"]) == 1
        prog, rest = bad["commands"][0]["keystrokes"].split(" ", 1)
        assert any(prog[:i] + prog[i + 1:] == "sort" for i in range(len(prog))) and rest == "in.txt > out.txt\n"
        assert terminus2.with_faults(replies, 0.0, rng) == replies
        faulted = terminus2.with_faults(replies, 1.0, rng)
        assert faulted[0].keys() == {"unscored"} and faulted[1:] == replies  # the only reply that does not complete
    with pytest.raises(ValueError, match="kind must be one of"):
        terminus2.fault_reply(SORT, "typo", random.Random(0))


def test_scripted_fault_turn_is_in_the_context_but_not_trained(tmp_path, tok):
    """--sft-faults: a trial of the scripted expert with a fault turn still resolves; the fault's tokens are in the
    sample (the context the expert's reply follows) with m = 0, every expert reply's with m = 1."""
    task = make_task(tmp_path, script=[SORT, DONE, {**DONE, "analysis": "checked"}])
    res = rollout.run_trial(task, "scripted", tokenizer=tok, script_faults=1.0, seed=2)
    assert res["resolved"] and res["exit_reason"] == "task_complete", res
    recs = res["records"]
    assert len(recs) == 4 and recs[0].get("unscored") and not any(r.get("unscored") for r in recs[1:])
    s, = rollout.to_samples([res], tmp_path, "sft")
    assert s["unscored_turns"] == [0]
    for i, (a, b) in enumerate(s["spans"]):
        assert list(s["tokens"][a:b]) == recs[i]["output_ids"]
        assert set(s["loss_mask"][a:b].tolist()) == {0 if i == 0 else 1}
    assert int(s["loss_mask"].sum()) == sum(len(r["output_ids"]) for r in recs[1:])
    plain = rollout.run_trial(task, "scripted", tokenizer=tok)
    assert plain["resolved"] and len(plain["records"]) == 3, {k: v for k, v in plain.items() if k != "records"}
    # a fault before the second work reply: after_faults trains only the replies after it
    check = {**SORT, "commands": [{"keystrokes": "wc -l out.txt\n", "duration": 0.1}]}
    script = [SORT, check, DONE, {**DONE, "analysis": "checked"}]
    task2 = make_task(tmp_path, name="sort-twice", script=script)
    seed = next(k for k in range(100)
                if "unscored" in terminus2.with_faults(script, 1.0, random.Random(f"sort-twice:{k}"))[1])
    res = rollout.run_trial(task2, "scripted", tokenizer=tok, script_faults=1.0, seed=seed)
    assert res["resolved"] and [bool(r.get("unscored")) for r in res["records"]] == [False, True, False, False, False]
    s, = rollout.after_faults(rollout.to_samples([res], tmp_path, "sft"))
    assert int(s["loss_mask"].sum()) == sum(len(r["output_ids"]) for r in res["records"][2:])
    assert int(s["loss_mask"][:s["spans"][1][1]].sum()) == 0
    assert rollout.after_faults(rollout.to_samples([plain], tmp_path, "sft")) == []  # no fault: nothing to add
    for agent, rate in (("oracle", 0.5), ("scripted", 1.5)):
        r = rollout.run_trial(task, agent, tokenizer=tok, script_faults=rate)
        assert r["exit_reason"] == "error" and "script_faults" in r["error"], r


def test_new_terminal_shows_its_prompt_before_keystrokes(box):
    """The terminal starts once bash's first prompt is there (a fast agent's keys no longer sit unread in the tty
    of a shell still starting on a loaded machine, the trial graded before they ran)."""
    assert box.read(0.0).endswith("/app$ ")


def _check_token_path(res, tok):
    recs = res["records"]
    for a, b in zip(recs, recs[1:]):  # every boundary strict: the next prompt extends prompt + output
        assert b["prompt_ids"][:len(a["prompt_ids"]) + len(a["output_ids"])] == a["prompt_ids"] + a["output_ids"]
    last = recs[-1]
    full = last["prompt_ids"] + last["output_ids"]
    mask = [0] * len(full)
    for r in recs:
        mask[len(r["prompt_ids"]):len(r["prompt_ids"]) + len(r["output_ids"])] = [1] * len(r["output_ids"])
    assert [t for t, m in zip(full, mask) if m] == [t for r in recs for t in r["output_ids"]]
    assert sum(mask) == sum(len(r["output_ids"]) for r in recs)
    return full


def test_scripted_replay_is_token_strict_with_parse_error_and_confirmation(task, tok):
    res = rollout.run_trial(task, "scripted", tokenizer=tok)
    assert res["exit_reason"] == "task_complete", res["error"]
    assert res["turns"] == 4 and res["resolved"] and res["passed"] == 3
    full = _check_token_path(res, tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert all(r["output_ids"][-1] == im_end and r["output_logprobs"] is None for r in res["records"])
    text = tok.decode(full)
    assert text.count("ERROR: your reply was not valid: no JSON object found") == 1
    assert res["invalid_replies"] == 1  # the one refused reply, counted (runstate.invalid_reply_frac)
    assert text.count("Are you sure the task is complete?") == 1
    assert text.startswith("<|im_start|>user\n") and text.count("<|im_start|>assistant\n") == 4
    assert tok.encode(text, add_special_tokens=False) == full  # same ids as rendering the chat as text


def test_run_trials_keeps_first_finished_and_cancels_rest(tmp_path):
    fast = [make_task(tmp_path, f"fast{i}") for i in range(2)]
    slow = make_task(tmp_path, "slow", solve="sleep 60")
    t0 = time.time()
    kept, dropped = rollout.run_trials([slow] + fast, "oracle", n_keep=2, max_workers=3)
    assert sorted(r["task"] for r in kept) == ["fast0", "fast1"] and all(r["resolved"] for r in kept)
    assert [d["task"] for d in dropped] == ["slow"] and dropped[0]["reason"] == "cancelled"
    assert dropped[0]["seconds"] < 30 and time.time() - t0 < 30


def test_model_agent_against_embedded_engine(task, tok, tmp_path):
    model = pytest.importorskip("model")
    engine_lib = pytest.importorskip("engine.server")
    path = tmp_path / "ckpt"
    model.save_checkpoint(model.build_actor(model.tiny_config(len(tok)), seed=0), tok, str(path))
    engine = engine_lib.EngineServer(str(path), port=0).start()
    try:
        client = EngineClient(engine.url)
        info = client.model_info()
        assert client.health() and info["top_k"] == model.TINY_TOP_K
        res = rollout.run_trial(task, "model", engine_url=engine.url, tokenizer=tok,
                                sampling={"temperature": 1.0, "max_new_tokens": 24, "seed": 0},
                                limits={"max_turns": 3})
    finally:
        engine.stop()
    assert res["exit_reason"] in ("max_turns", "task_complete"), res["error"]
    assert res["turns"] == len(res["records"]) >= 2 and res["weight_versions"] == ["0"]
    _check_token_path(res, tok)
    L = info["num_moe_layers"]
    for r in res["records"]:
        n = len(r["prompt_ids"]) + len(r["output_ids"])
        assert r["routed_experts"].shape == (n - 1, L, model.TINY_TOP_K)
        assert len(r["output_logprobs"]) == len(r["output_ids"]) and r["finish_reason"] in ("stop", "length")


# --- keystrokes never block -------------------------------------------------------------------------

def _send_in_thread(box, keys, **kw):
    """send_keys in a daemon thread -> (thread, result dict): a send that hangs fails the test instead of hanging it."""
    import threading
    res = {}

    def run():
        res["dropped"] = box.send_keys(keys, **kw)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, res


def _start_sleep(box):
    box.send_keys("sleep 100\n")
    deadline = time.time() + 15
    while not any(cmdline(p) == "sleep 100" for p in uid_procs(box.uid)) and time.time() < deadline:
        time.sleep(0.05)
    assert any(cmdline(p) == "sleep 100" for p in uid_procs(box.uid))


@pytest.mark.parametrize("mb", [1, 4])
def test_large_paste_into_busy_terminal_returns_by_deadline(box, mb):
    """`sleep 100` in the foreground reads nothing: mb MB of keystrokes fill the tty's queue; send_keys gives up at
    its deadline (before: a blocking write on the pty master hung the trial thread forever) and says what it dropped."""
    _start_sleep(box)
    th, res = _send_in_thread(box, ("x" * 99 + "\n") * ((mb << 20) // 100), deadline=time.time() + 3)
    th.join(60)
    assert not th.is_alive(), "send_keys blocked past its deadline"
    assert 0 < res["dropped"] <= mb << 20 and box.keys_dropped == res["dropped"]
    assert f"{res['dropped']} of {100 * ((mb << 20) // 100)} bytes of keystrokes not delivered" in box.read(0.2)
    box.close()  # and the jail still closes
    assert box.pid is None


def test_large_paste_without_deadline_ends_on_cancellation(task, tmp_path):
    """No deadline given: setting the trial's stop_event ends the send (before: it ignored cancellation)."""
    import threading
    stop = threading.Event()
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial", Limits(max_procs=32),
                         stop_event=stop) as b:
        _start_sleep(b)
        th, res = _send_in_thread(b, "y\n" * (1 << 20))
        time.sleep(1)
        assert th.is_alive()  # still trying: the terminal takes nothing while sleep runs
        stop.set()
        th.join(30)
        assert not th.is_alive(), "send_keys ignored stop_event"
        assert res["dropped"] > 0


def test_large_paste_with_no_progress_gives_up_after_max_duration(task, tmp_path):
    """Neither deadline nor cancellation: a terminal that takes no byte for limits.max_duration_s ends the send."""
    limits = Limits(max_procs=32, max_duration_s=2.0)
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial", limits) as b:
        _start_sleep(b)
        th, res = _send_in_thread(b, "z\n" * (1 << 19))
        th.join(60)
        assert not th.is_alive(), "send_keys blocked forever"
        assert res["dropped"] > 0 and "took none of them for 2 s" in b.read(0.2)


def test_large_paste_into_reading_command_is_delivered_whole(box):
    """A command that reads (cat > file) gets all 1 MB of a paste: output is drained while writing, no deadlock."""
    box.send_keys("stty -icanon; cat > /tmp/big; stty icanon\n")
    time.sleep(0.5)
    line = ("w" * 1023 + "\n")
    assert box.send_keys(line * 1024, deadline=time.time() + 60) == 0
    box.send_keys("C-d")
    box.read(1)
    rc, out = box.exec("wc -c < /tmp/big")
    assert out.strip() == str(1 << 20), out


# --- tasks that need their image; the CLI ----------------------------------------------------------
TB2_TEST_SH = """#!/bin/bash
set -e
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
uvx \\
  -p 3.13 \\
  -w pytest==8.4.1 \\
  -w pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
"""
PYTEST_ONLY_TEST_SH = """#!/bin/bash
# pytest and its CTRF plugin, installed only if missing
command -v pytest >/dev/null 2>&1 || pip install pytest==8.4.1 pytest-json-ctrf==0.3.5
if ! command -v uv >/dev/null 2>&1; then
  pip install pytest pytest-json-ctrf
fi
mkdir -p /logs/verifier
pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
"""


def _with(task, dockerfile=None, test_sh=None, toml_extra=""):
    if dockerfile is not None:
        (task / "environment/Dockerfile").write_text(dockerfile)
    if test_sh is not None:
        (task / "tests/test.sh").write_text(test_sh)
    if toml_extra:
        (task / "task.toml").write_text((task / "task.toml").read_text() + toml_extra)
    return task


def test_image_needs_names_what_the_jail_lacks(tmp_path):
    """image_needs: a docker_image, a Dockerfile that builds something, Terminal-Bench 2's stock test.sh (curl uv,
    uvx) and a pip install of a missing requirement are named; generated tasks and guarded pytest installs are not."""
    cases = {
        "image": dict(toml_extra='\n[environment]\ndocker_image = "ghcr.io/x/y:1"\n'),
        "build": dict(dockerfile="FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y no-such-pkg-t1 \\\n"
                                 "    && cargo build --release\nWORKDIR /app\nCOPY data.txt /app/\n"),
        "base": dict(dockerfile="FROM rust:1.75\nWORKDIR /workspace\n"),
        "tb2": dict(test_sh=TB2_TEST_SH),
        "pipdep": dict(test_sh="#!/bin/bash\npip install no-such-dist-t1 pytest\npytest /tests\n"),
        "generated": dict(dockerfile=data.DOCKERFILE, test_sh=data.TEST_SH),
        "guarded": dict(dockerfile="FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\nWORKDIR /app\n",
                        test_sh=PYTEST_ONLY_TEST_SH),
    }
    got = {k: task_io.image_needs(task_io.load_task(_with(make_task(tmp_path, k), **kw))) for k, kw in cases.items()}
    assert got["image"] == ["task.toml [environment] docker_image = 'ghcr.io/x/y:1'"]
    assert [r.split("`")[1].split()[0] if "`" in r else r.split()[1] for r in got["build"]] == ["apt-get", "cargo",
                                                                                                 "COPY"]
    assert "no-such-pkg-t1" in got["build"][0] and "FROM rust:1.75" in got["base"][0]
    assert "WORKDIR /workspace" in got["base"][1] and len(got["base"]) == 2
    assert {r.split("`")[1].split()[0] for r in got["tb2"]} == {"apt-get", "curl", "uvx"}
    assert len(got["pipdep"]) == 1 and "no-such-dist-t1" in got["pipdep"][0]
    assert got["generated"] == [] and got["guarded"] == []


def test_task_that_needs_its_image_is_refused_up_front(tmp_path):
    """The local jail refuses a task whose verifier would fetch its tools (scored 0 silently before), naming the
    way out; the daytona sandbox does not refuse it for that."""
    task = _with(make_task(tmp_path), test_sh=TB2_TEST_SH)
    res = rollout.run_trial(task, "oracle")
    assert res["exit_reason"] == "error" and res["reward"] == 0.0
    assert "needs its image: use --sandbox daytona or Harbor's docker environment" in res["error"]
    assert "uvx" in res["error"] and "curl" in res["error"]
    res = rollout.run_trial(task, "oracle", sandbox="daytona")
    assert res["exit_reason"] == "error" and "needs its image" not in res["error"]  # fails later: no Daytona here


def test_terminal_bench_style_pytest_task_runs_unchanged(tmp_path):
    """A Terminal-Bench-style task (Dockerfile FROM + WORKDIR, no app/; test.sh installing pytest only if missing,
    then pytest --ctrf) runs in the local jail as it is: the oracle resolves it from the CTRF report."""
    task = _with(make_task(tmp_path, solve="printf 'apple\\nbanana\\nfig\\nkiwi\\npear\\n' > in.txt; "
                                           "sort in.txt > out.txt"),
                 dockerfile="FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\nWORKDIR /app\n",
                 test_sh=PYTEST_ONLY_TEST_SH)
    shutil.rmtree(task / "environment/app")
    res = rollout.run_trial(task, "oracle")
    assert res["exit_reason"] == "oracle", res["error"]
    assert (res["reward_source"], res["passed"], res["total"], res["resolved"]) == ("ctrf", 3, 3, True)


def _cli(*args):
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "rollout.py"), *map(str, args)], capture_output=True,
                       text=True, timeout=300, cwd=root)
    lines = p.stdout.strip().splitlines()
    return p.returncode, (json.loads(lines[-1]) if lines else None), p.stderr


def test_cli_reports_reward_source_and_keeps_the_trial_dir(tmp_path):
    """python rollout.py --keep DIR: exit 0, reward_source / reward_reason in the JSON, the trial dir kept with its
    logs and its path printed."""
    rc, out, err = _cli("--task", make_task(tmp_path), "--agent", "oracle", "--keep", tmp_path / "kept")
    assert rc == 0, err
    assert (out["exit_reason"], out["reward_source"], out["reward_reason"], out["passed"]) == ("oracle", "ctrf",
                                                                                                None, 3)
    trial = out["trial_dir"]
    assert os.path.dirname(trial) == str(tmp_path / "kept") and f"trial directory kept: {trial}" in err
    assert os.path.isfile(os.path.join(trial, "verifier", "logs", "ctrf.json"))  # the verifier's own /logs/verifier
    assert open(os.path.join(trial, "host", "oracle.txt")).read().startswith("[exit 0]")  # host-written logs


def test_cli_gives_the_binary_fallback_its_reason(tmp_path):
    """A verifier that writes only reward.txt: reward_source binary and the reason the CTRF report was not used."""
    task = _with(make_task(tmp_path), test_sh="#!/bin/bash\nmkdir -p /logs/verifier\n"
                                             "echo 1 > /logs/verifier/reward.txt\n")
    rc, out, err = _cli("--task", task, "--agent", "oracle")
    assert rc == 0, err
    assert out["reward_source"] == "binary" and "missing CTRF" in out["reward_reason"]


def test_cli_exits_nonzero_when_the_trial_errored(tmp_path):
    """An errored trial (missing task dir; a task that needs its image) exits 1 with the reason on stderr and in the
    JSON; a missing --model-path is a flag error (2)."""
    rc, out, err = _cli("--task", tmp_path / "missing", "--agent", "oracle")
    assert rc == 1 and out["exit_reason"] == "error" and "does not exist" in out["error"] and "error:" in err
    rc, out, err = _cli("--task", _with(make_task(tmp_path), test_sh=TB2_TEST_SH), "--agent", "nop")
    assert rc == 1 and "needs its image: use --sandbox daytona" in err
    rc, out, err = _cli("--task", make_task(tmp_path, "other"), "--agent", "scripted")
    assert rc == 2 and "needs --model-path" in err


def test_image_needs_refuses_hostile_task_files(tmp_path):
    """A test.sh that is a link to a host device or file, or too large to parse, or an [environment] that is not a
    table: a clear error or 'not checked' (so the image is asked for), never a read of /dev/zero."""
    task = make_task(tmp_path)
    (task / "tests/test.sh").unlink()
    (task / "tests/test.sh").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="test.sh: not a regular file inside the task dir"):
        task_io.image_needs(task_io.load_task(task))
    (task / "tests/test.sh").unlink()
    (task / "tests/test.sh").symlink_to("/etc/passwd")
    with pytest.raises(ValueError, match="not a regular file inside the task dir"):
        task_io.image_needs(task_io.load_task(task))
    (task / "tests/test.sh").unlink()
    (task / "tests/test.sh").write_text("pytest /tests\n" * 100_000)  # 1.4 MB
    assert task_io.image_needs(task_io.load_task(task)) == [f"tests/test.sh larger than {task_io.CHECK_BYTES} bytes: "
                                                      "not checked"]
    other = make_task(tmp_path, "other")
    (other / "task.toml").write_text('environment = "x"\n' + (other / "task.toml").read_text())
    with pytest.raises(ValueError, match=r"\[environment\] must be a table"):
        task_io.image_needs(task_io.load_task(other))
    rc, out, err = _cli("--task", make_task(tmp_path, "third"), "--agent", "nop", "--keep", other / "task.toml")
    assert rc == 2 and "is not a directory" in err


def test_trial_pasting_into_a_busy_terminal_ends_at_its_timeout(tmp_path):
    """Through the agent loop: `sleep 100`, then 200 KB of keystrokes; the trial ends at its agent timeout (8 s)
    and is scored (before: the trial thread blocked in the write for good)."""
    import threading
    paste = {**SORT, "commands": [{"keystrokes": "sleep 100\n", "duration": 0.5},
                                  {"keystrokes": "x\n" * 100_000, "duration": 1.0}]}
    task = make_task(tmp_path, script=[paste, DONE, DONE], agent_timeout=8)
    res = {}
    th = threading.Thread(target=lambda: res.update(rollout.run_trial(task, "scripted", tokenizer=_tok(),
                                                                      limits={"max_total_tokens": 10**6})),
                          daemon=True)
    th.start()
    th.join(120)
    assert not th.is_alive(), "the trial blocked past its timeout"
    assert res["exit_reason"] == "timeout" and res["reward_source"] == "ctrf", res["error"]


def test_the_scripted_expert_reads_each_output_whole_whatever_its_duration(tmp_path, tok):
    """The SFT transcripts do not depend on the machine's load: a scripted command slower than its reply's duration
    (0.1 s) is read until the shell's prompt is back, so its output is in the next observation, not cut at 0.1 s;
    a model's commands keep the duration (terminus2 departure 3)."""
    slow = {**SORT, "commands": [{"keystrokes": "sleep 1.5; echo settled-$((6 * 7))\n", "duration": 0.1},
                                 {"keystrokes": "sort in.txt > out.txt\n", "duration": 0.1}]}
    task = make_task(tmp_path, script=[slow, DONE, DONE])
    res = rollout.run_trial(task, "scripted", tokenizer=tok)
    assert res["exit_reason"] == "task_complete" and res["resolved"], res["error"]
    assert "settled-42" in tok.decode(res["records"][1]["prompt_ids"])  # the observation after turn 1 (the command
    # itself reads settled-$((6 * 7)))
