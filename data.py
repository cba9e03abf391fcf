"""Task synthesis and audit in Harbor's task format (T1 paper, section "data").

Paper (T1, arXiv 2609.11042): recursive task synthesis (RST) from verified seed tasks, every reference solution
run in a fresh sandbox, then a five-stage, 15-round LLM audit over eight weighted dimensions that hard-rejects
hidden requirements, test leakage, solution shortcuts and weak verifiers; the accepted tasks, ordered by quality,
form T1-15k, reshuffled every epoch. Each task's verifier writes the CTRF report behind r = P/S (reward.py).

Run:
    python data.py generate --out runs/tasks --n-train 120 --n-heldout 30 --seed 0 [--rst-rounds 2]
        # writes DIR/train/<task>/, DIR/heldout/<task>/, DIR/summary.json; prints the audit statistics
        # (accepted / borderline / rejected per reason and family), then one JSON line
    T1_TASK_CACHE=DIR python data.py generate ...  # any generate_tasks call: a pool of the same arguments and code
        # is copied from DIR ("[data] tasks from the cache"), else generated and stored there (tasks/pool_cache.py)
    rst.audit(task_dir)  # the four hard rejects and the eight-dimension quality score: tasks/rst.py
    task_io.load_task(dir), task_io.image_needs(task)  # a task dir, and what the jail cannot run: sandbox/task_io.py
    copy_samples(tok, copy_items(corpus(dirs)), n, seed, names, share)  # the base phase's copy data (tasks/copying.py)
    eval_splits(out_dir, seed, n_val, n_test, n_deep, n_names, avoid=train_dirs, rst_rounds=1)  # {"val", "test",
        # "test_deep", "test_names": [task dirs]}, audited; overlap(train, test) says how new (tasks/splits.py)

A task dir (Harbor): task.toml ([metadata] family, difficulty, template, names, split, quality, audit (the verdict),
n_assertions; [verifier] and [agent] timeout_sec; [environment]), instruction.md, environment/ (Dockerfile, app/ =
the initial /app), tests/test.sh + tests/test_outputs.py, solution/solve.sh and solution/terminus2.json (the
expert's replies for SFT). n_assertions (reward.compute refuses a report with more tests): task.toml's for our
tasks, else the oracle's count in t1_audit.json (a task.toml this project did not write is never rewritten).

Departures from the paper:
1. No LLM: the seeds are 6 templated families of real shell work and RST's rewriting draws from a fixed library
   of operations (tasks/families.py, its departure 1).
2. The audit is mechanical: validate() (the oracle resolves with reward == total/S and total == n_assertions, nop
   scores below full, the scripted expert resolves), then rst.audit's rule-based hard rejects, not an LLM's.
3. `quality` is rst.audit's weighted score (task.toml, with the verdict); a draft rejected by either is redrawn,
   never repaired. With --no-validate it stays a heuristic (assertion count + family difficulty).
4. Instructions and expert replies are short and formulaic (tasks/families.py, its departures 2 and 3).
5. Train and held-out pools share families and vocabularies but never an instruction (different parameter draws);
   the split is recorded in task.toml. The paper tests on tasks it never trained on (Terminal-Bench 2); here
   eval_splits adds splits by purpose (tasks/splits.py): validation, test (in-template), test_deep (RST depth 2-3,
   templates no training pool has) and test_names (families.UNSEEN's names and values); overlap() says how new each is.
"""
import argparse
import collections
import concurrent.futures as cf
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time


def build_parser() -> argparse.ArgumentParser:
    """`python data.py generate | audit` (stdlib only: --help answers before torch loads)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(description="T1 task synthesis + audit (Harbor format)", formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write and audit the train and held-out pools", formatter_class=fmt)
    g.add_argument("--out", required=True, default=argparse.SUPPRESS, help="the pools' folder (required)")
    g.add_argument("--n-train", type=int, default=120, help="training tasks")
    g.add_argument("--n-heldout", type=int, default=30, help="held-out tasks")
    g.add_argument("--seed", type=int, default=0, help="seed of the task draws")
    g.add_argument("--no-validate", action="store_true", help="skip the sandbox audit")
    g.add_argument("--no-scripted", action="store_true", help="skip the scripted-trajectory check")
    g.add_argument("--workers", type=int, default=2, help="tasks audited at once")
    g.add_argument("--rst-rounds", type=int, default=0, help="RST steps added to each seed task (families.rst_extend)")
    au = sub.add_parser("audit", help="audit task dirs in fresh sandboxes; --judge URL adds the LLM's semantic audit",
                        formatter_class=fmt)
    au.add_argument("dirs", nargs="+", help="task dirs, or folders of task dirs")
    au.add_argument("--judge", default=None, help="OpenAI-compatible endpoint (the project's gateway too)")
    au.add_argument("--judge-rounds", type=int, default=15, help="replies per task (paper: 15; rst.JUDGE_ROUNDS)")
    au.add_argument("--model", default="t1", help="the model name the endpoint expects")
    au.add_argument("--workers", type=int, default=2, help="tasks audited at once")
    return p


if __name__ == "__main__":
    ARGV = build_parser().parse_args()  # --help and bad flags answer here, before torch loads

from tasks import copying, families  # noqa: E402
import model  # noqa: E402
from chat_tokens import ASSISTANT_PREFIX, IM_END  # noqa: E402
import reward  # noqa: E402
import rollout  # noqa: E402
from tasks import pool_cache  # noqa: E402
from tasks import rst  # noqa: E402
from tasks import splits  # noqa: E402
from tasks.splits import overlap, template_of  # noqa: E402,F401 (data.overlap, data.template_of)
from sandbox import task_io  # noqa: E402

SCALE = reward.SCALE  # S of r = P/S, one source (reward.py); a resolved oracle must score total/S
DEEP_DEPTHS = (2, 3)  # RST depths of the out-of-template split (this project's; training pools use rst_rounds <= 1)


TEST_HEADER = '''import gzip, json, os, stat, subprocess, tarfile

A = "/app"


def _read(p):
    with open(os.path.join(A, p)) as f:
        return f.read()


def _lines(p):
    return _read(p).splitlines()


def _mode(p):
    return stat.S_IMODE(os.stat(os.path.join(A, p)).st_mode)


def _bytes(p):
    with open(os.path.join(A, p), "rb") as f:
        return f.read()
'''
TEST_SH = """#!/bin/bash
# Harbor verifier: per-assertion CTRF report (dense reward r = P/S) + binary reward.txt
mkdir -p /logs/verifier
cd /tests && pytest --ctrf /logs/verifier/ctrf.json test_outputs.py -rA; rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
DOCKERFILE = """FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends jq tmux \\
    && rm -rf /var/lib/apt/lists/* && pip install --no-cache-dir pytest pytest-json-ctrf
WORKDIR /app
COPY app/ /app/
"""



def quality(family, n_tests):
    """Heuristic quality in [0, 1] before the audit (departure 3): more assertions and harder families first."""
    return round(min(1.0, 0.1 * n_tests + (0.4 if families.DIFFICULTY[family] == "medium" else 0.2)), 3)


def write_task(task_dir, spec, family, split, seed, expert_text="full"):
    """Write one Harbor task dir from a family spec (solution/terminus2.json: families.expert_replies)."""
    if os.path.exists(task_dir):
        shutil.rmtree(task_dir)
    app = os.path.join(task_dir, "environment", "app")
    os.makedirs(app)
    for rel, content in spec["files"].items():
        p = os.path.join(app, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())
        os.chmod(p, 0o644)  # explicit: the perms family's nop check must not depend on the umask
    n = len(spec["tests"])
    names = sorted({part for rel in list(spec["files"]) + spec["outputs"] for part in rel.split("/")})
    toml = (f'version = "1.0"\n\n[metadata]\nfamily = "{family}"\ndifficulty = "{families.DIFFICULTY[family]}"\n'
            f'template = "{spec["template"]}"\nnames = {json.dumps(names)}\n'
            f'split = "{split}"\nquality = {quality(family, n)}\nn_assertions = {n}\nseed = "{seed}"\n'
            f'author_name = "{splits.AUTHOR}"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 300.0\n\n'
            f'[environment]\nbuild_timeout_sec = 600.0\ncpus = 1\nmemory_mb = 1024\n')
    body = TEST_HEADER + "".join(f"\n\ndef test_{name}():\n" + "".join(f"    {ln}\n" for ln in lines)
                                 for name, lines in spec["tests"])
    solve = "#!/bin/bash\nset -e\ncd /app\n" + "".join(c + "\n" for t in spec["turns"] for c in t["cmds"])
    out = {"task.toml": toml, "instruction.md": spec["instruction"] + "\n", "environment/Dockerfile": DOCKERFILE,
           "tests/test.sh": TEST_SH, "tests/test_outputs.py": body, "solution/solve.sh": solve,
           "solution/terminus2.json": json.dumps(families.expert_replies(spec, expert_text), indent=1) + "\n"}
    for rel, text in out.items():
        p = os.path.join(task_dir, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    for rel in ("tests/test.sh", "solution/solve.sh"):
        os.chmod(os.path.join(task_dir, rel), 0o755)
    return task_dir


# --- audit --------------------------------------------------------------------------------------
def static_audit(spec):
    """Mechanical versions of the paper's hard rejects; returns a reason or None."""
    if len(spec["tests"]) < 3:
        return "weak verifier: fewer than 3 assertions"
    for o in spec["outputs"]:
        if o not in spec["instruction"]:
            return f"hidden requirement: output {o} not named in the instruction"
        if o not in spec.get("edits", ()) and any(rel == o or rel.startswith(o + "/") for rel in spec["files"]):
            return f"solution shortcut: output {o} already in /app"
    for rel in spec["files"]:
        if os.path.basename(rel) in ("test_outputs.py", "test.sh", "solve.sh", "terminus2.json"):
            return f"test leakage: {rel} in /app"
    return None


def validate(task_dir, tokenizer=None, work_root=None, record=True):
    """Audit in fresh sandboxes: the oracle must resolve with its CTRF report, reward == total/S, and as many
    tests as the task's recorded n_assertions (when it has none and record is True, the oracle's count is
    written to task_io.AUDIT_FILE in the task dir once the audit passes: reward.compute bounds P by it);
    nop must score below full; the scripted expert trajectory must resolve (when a tokenizer is given).
    Returns None when the task passes, else the reason."""
    return _validate(task_dir, tokenizer, work_root, record)[0]


def _validate(task_dir, tokenizer=None, work_root=None, record=True):
    """validate() -> (reason, the oracle's run_trial result or None): rst.audit reuses the oracle's trial."""
    try:
        task = task_io.load_task(task_dir)
    except ValueError as e:
        return f"task dir: {e}", None
    ref = rollout.run_trial(task_dir, "oracle", work_root=work_root)
    why = ref.get("reward_reason") or ref.get("error") or ""
    if ref.get("reward_source") != "ctrf":
        return f"oracle has no usable CTRF report ({ref.get('reward_source')}): {why}".strip(), ref
    if not (ref["resolved"] and ref["total"] > 0 and abs(ref["reward"] - ref["total"] / SCALE) < 1e-9):
        return f"oracle not resolved: {ref['passed']}/{ref['total']} {why}".strip(), ref
    if task.n_assertions is not None and ref["total"] != task.n_assertions:
        return (f"assertion count: the oracle's report has {ref['total']} tests, the task records "
                f"n_assertions = {task.n_assertions}"), ref
    res = rollout.run_trial(task_dir, "nop", work_root=work_root)
    if res["passed"] >= res["total"]:
        return "weak verifier: nop scores full", ref
    if tokenizer is not None:
        res = rollout.run_trial(task_dir, "scripted", tokenizer=tokenizer, work_root=work_root)
        if not res["resolved"]:
            return f"scripted not resolved: {res['passed']}/{res['total']} {res.get('error') or ''}".strip(), ref
    if task.n_assertions is None and record:
        _write_audit(task_dir, dict(n_assertions=ref["total"], audited_by="data.validate (oracle run)"))
    return None, ref


def _write_audit(task_dir, doc):
    """Write AUDIT_FILE (task_io) atomically (a temp file renamed over it), never through a link."""
    name = task_io.AUDIT_FILE
    path, tmp = os.path.join(task_dir, name), os.path.join(task_dir, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
        f.write("\n")
    os.replace(tmp, path)


# --- pools ----------------------------------------------------------------------------------------
def _draw(split, slot, seed, seen, attempt=0, rst_rounds=0, rst_share=1.0, rst_depths=None, vocab="train",
          random_share=0.0):
    """Deterministic spec for one slot of a split (family = slot mod 6), extended by rst_rounds RST steps (in a
    share rst_share of the slots, drawn per slot), skipping instructions already used and drafts failing the static
    audit. rst_depths (depths >= 1; rst_rounds and rst_share aside): the slot's depth drawn from it, its family one of
    families.rst_families(depth), a draft with fewer steps redrawn. vocab: the names' vocabulary (families.VOCABS), or
    for a share random_share of the slots (drawn per slot) a made-up one (copying.random_vocab, one per draw)."""
    if random_share and random.Random(f"{seed}/{split}/{slot}/vocab").random() < random_share:
        vocab = "random"
    if rst_depths:
        rst_rounds = random.Random(f"{seed}/{split}/{slot}/depth").choice(sorted(rst_depths))
    fams = families.rst_families(rst_rounds) if rst_depths else tuple(families.FAMILIES)
    family = fams[slot % len(fams)]
    if not rst_depths and rst_share < 1.0 and random.Random(f"{seed}/{split}/{slot}/rst").random() >= rst_share:
        rst_rounds = 0  # a seed task (the rng of the draw below is the same either way)
    first = attempt
    while True:
        sd = f"{seed}/{split}/{slot}/{attempt}"
        rng = families.VocabRandom(sd, copying.random_vocab(sd) if vocab == "random" else vocab)  # train: Random's
        spec = families.FAMILIES[family](rng)
        if rst_rounds:
            spec = families.rst_extend(spec, family, rng, rst_rounds)
        deep = not rst_depths or families.rst_depth(spec) == rst_rounds
        if deep and spec["instruction"] not in seen and static_audit(spec) is None:
            seen.add(spec["instruction"])
            return family, spec, sd
        attempt += 1
        if attempt - first > 200:
            depth = f" of RST depth {rst_rounds}" if rst_depths else ""
            raise RuntimeError(f"cannot draw a new {family} task{depth} for {split} slot {slot}")


def generate_tasks(out_dir, n_train, n_heldout, seed, validate_tasks=True, scripted=True, workers=2, rst_rounds=0,
                   validate_train=True, expert_text="full", heldout_split="heldout", avoid=(), rst_share=1.0,
                   rst_depths=None, vocab="train", random_share=0.0):
    """Write n_train + n_heldout audited tasks under out_dir/{train,heldout}/ (each seed task extended by
    rst_rounds RST steps: families.rst_extend; in a share rst_share of the slots only, the rest seed tasks;
    terminus2.json's free text by expert_text: families.expert_replies).
    validate_train=False audits the held-out split alone (a large RL pool: the audit costs ~2.6 s a task here).
    heldout_split names the second split (its folder, its tasks' names and their draws): "val" for a validation set;
    avoid: instructions no new task may have (the pools of an earlier call).
    rst_depths (e.g. DEEP_DEPTHS): every task of both splits gets a depth drawn from it per slot (_draw: rst_rounds
    and rst_share aside; a family that cannot reach the depth left out of the slot); vocab: "train" (the pools' as
    they always were) or "unseen" (families.UNSEEN); random_share: that share of the slots made-up (_draw).

    Tasks failing validate() or rst.audit (hard reject, or quality under rst.BORDERLINE) are dropped and redrawn
    (up to 3 rounds); drops and the audit statistics are in out_dir/summary.json. Returns (train_dirs, heldout_dirs).
    With T1_TASK_CACHE=DIR set, a pool generated earlier with the same arguments (workers aside) by the same code is
    copied from DIR instead (tasks/pool_cache.py)."""
    args = dict(n_train=n_train, n_heldout=n_heldout, seed=seed, validate_tasks=validate_tasks, scripted=scripted,
                rst_rounds=rst_rounds, validate_train=validate_train, expert_text=expert_text,
                heldout_split=heldout_split, avoid=sorted(set(avoid)), rst_share=rst_share,
                rst_depths=sorted(set(rst_depths)) if rst_depths else None, vocab=vocab, random_share=random_share)
    if vocab not in families.VOCABS or any(not isinstance(d, int) or d < 1 for d in args["rst_depths"] or ()) or \
            not 0 <= random_share <= 1:
        raise ValueError(f"generate_tasks: vocab must be one of {sorted(families.VOCABS)}, rst_depths ints >= 1 and "
                         f"random_share in [0, 1], got {vocab!r}, {rst_depths!r}, {random_share!r}")
    return pool_cache.cached(out_dir, args, lambda: _generate_tasks(out_dir, workers=workers, **args))


def _generate_tasks(out_dir, n_train, n_heldout, seed, validate_tasks, scripted, workers, rst_rounds, validate_train,
                    expert_text, heldout_split, avoid, rst_share, rst_depths, vocab, random_share):
    """generate_tasks without the cache."""
    t0 = time.time()
    seen = set(avoid)  # instructions of both splits (and avoid): train and held-out never share one
    specs = {}
    kw = dict(rst_rounds=rst_rounds, rst_share=rst_share, rst_depths=rst_depths, vocab=vocab, random_share=random_share)
    for split, n in (("train", n_train), (heldout_split, n_heldout)):
        for slot in range(n):
            family, spec, sd = _draw(split, slot, seed, seen, **kw)
            name = f"{split}-{slot:04d}-{family}"
            specs[(split, slot)] = write_task(os.path.join(out_dir, split, name), spec, family, split, sd, expert_text)
    tokenizer, scripted_note = None, "off"
    if validate_tasks and scripted:
        try:
            tokenizer, scripted_note = model.train_tokenizer(corpus(list(specs.values()))), "on"
        except (ImportError, AttributeError) as e:
            scripted_note = f"skipped: no tokenizer ({e})"
    drops, unrecovered = collections.Counter(), 0
    pending = {k: d for k, d in specs.items() if validate_tasks and (validate_train or k[0] != "train")}
    work_root = os.path.join(out_dir, ".sandboxes")
    audits = []  # one row per audited draft (redrawn slots too): family, verdict, reason, seconds

    def check(key):  # sandbox validation (oracle, nop, expert), then the hard rejects and the quality score
        d, fam = specs[key], task_io.load_task(specs[key]).config["metadata"]["family"]
        t = time.time()
        reason, ref = _validate(d, tokenizer, work_root)
        if reason is not None:
            return dict(family=fam, verdict="rejected", reason=reason, seconds=round(time.time() - t, 2))
        a = rst.audit(d, work_root, expert_resolved=True if tokenizer is not None else None, reference=ref)
        if a["reason"] is None and a["verdict"] == "rejected":
            a["reason"] = f"low_quality: {a['quality']} < {rst.BORDERLINE}"
        if a["verdict"] != "rejected":
            _set_quality(d, a["quality"], a["verdict"])
        return dict(a, family=fam, audit_s=a["seconds"], seconds=round(time.time() - t, 2))

    for rnd in range(3):  # audit; a dropped slot is redrawn (same family) and audited again
        with cf.ThreadPoolExecutor(workers) as pool:
            rows = dict(zip(pending, pool.map(check, pending)))
        audits += [rows[k] for k in sorted(rows)]
        pending = {}
        for key, reason in sorted((k, r["reason"]) for k, r in rows.items() if r["reason"]):
            drops[reason.split(":")[0]] += 1
            print(f"[data] dropped {specs[key]}: {reason}", flush=True)
            shutil.rmtree(specs.pop(key))
            if rnd == 2:
                unrecovered += 1
                continue
            family, spec, sd = _draw(*key, seed, seen, attempt=1000 * (rnd + 1), **kw)
            d = os.path.join(out_dir, key[0], f"{key[0]}-{key[1]:04d}-{family}")
            specs[key] = pending[key] = write_task(d, spec, family, key[0], sd, expert_text)
        if not pending:
            break
    shutil.rmtree(work_root, ignore_errors=True)
    train = [specs[k] for k in sorted(specs) if k[0] == "train"]
    heldout = [specs[k] for k in sorted(specs) if k[0] == heldout_split]
    tasks = {d: task_io.load_task(d) for d in train + heldout}
    assert not {tasks[d].instruction for d in train} & {tasks[d].instruction for d in heldout}, "split overlap"
    n_asserts = [t.config["metadata"]["n_assertions"] for t in tasks.values()]
    summary = dict(train=len(train), heldout=len(heldout), seed=seed, vocab=vocab, rst_depths=rst_depths,
                   families=dict(collections.Counter(t.config["metadata"]["family"] for t in tasks.values())),
                   validated=validate_tasks, train_validated=validate_tasks and validate_train,
                   scripted_check=scripted_note, dropped=dict(drops),
                   dropped_total=sum(drops.values()), unrecovered=unrecovered,
                   assertions_min=min(n_asserts, default=0), assertions_max=max(n_asserts, default=0),
                   assertions_mean=round(sum(n_asserts) / max(1, len(n_asserts)), 2),
                   audit=rst.audit_stats(audits), seconds=round(time.time() - t0, 1))
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return train, heldout


def _set_quality(task_dir, q, verdict):
    """Write the audit's quality and verdict into a generated task's task.toml ([metadata])."""
    path = os.path.join(task_dir, "task.toml")
    with open(path) as f:
        toml = f.read()
    toml = re.sub(r"^quality = .*$", f'quality = {q}\naudit = "{verdict}"', toml, count=1, flags=re.M)
    with open(path, "w") as f:
        f.write(toml)


def instructions(task_dirs) -> set:
    """The instructions of task dirs (two pools never share one)."""
    return {task_io.load_task(d).instruction for d in task_dirs}


def sft_pool(out_dir, n, seed, avoid, **kw) -> list:
    """The SFT pool of --n-sft-tasks: n fresh tasks under out_dir (not sandbox-audited: the verifier audits their
    scripted trajectories), less any sharing an instruction with a task of `avoid` (the other pools: RL's tasks are
    new to SFT). kw: generate_tasks' rst_rounds, expert_text, rst_share, random_share."""
    extra, _ = generate_tasks(out_dir, n, 0, seed, validate_tasks=False, **kw)
    taken = instructions(avoid)
    return [d for d in extra if task_io.load_task(d).instruction not in taken]


def validation_pool(out_dir, n, seed, pools, sft_dir=None, **kw) -> list:
    """n validation tasks under out_dir (drawn like the held-out ones, split "val"), none sharing an instruction with
    a task of `pools` or of an SFT pool already drawn under sft_dir/train (a validation set added on resume).
    kw: generate_tasks' rst_rounds, expert_text, workers."""
    sft = os.path.join(sft_dir, "train") if sft_dir is not None else None
    drawn = task_dirs_under([sft]) if sft is not None and os.path.isdir(sft) and os.listdir(sft) else []
    taken = [task_io.load_task(d).instruction for d in list(pools) + drawn]
    _, val = generate_tasks(out_dir, 0, n, seed, heldout_split="val", avoid=taken, **kw)
    return val


def eval_splits(out_dir, seed, n_val, n_test, n_deep, n_names, avoid=(), rst_rounds=0, expert_text="full",
                workers=2, rst_depths=DEEP_DEPTHS, scripted=True) -> dict:
    """A run's evaluation splits (tasks/splits.py: what each is for), each drawn by generate_tasks under
    out_dir/<split>/ and sandbox-audited like the held-out pool, its name in task.toml [metadata] split:
    {"val": n_val, "test": n_test (in-template: unseen instances, rst_rounds like the training pools), "test_deep":
    n_deep (RST depths rst_depths), "test_names": n_names (in-template, families.UNSEEN's names and values)}, none
    sharing an instruction with a task of `avoid` (the training pools' dirs) or of an earlier split. A split of 0
    tasks is []. scripted: generate_tasks' (the scripted expert's trajectory checked too)."""
    if n_deep and rst_rounds >= min(rst_depths):  # test_deep's templates would be training templates
        raise ValueError(f"eval_splits: rst_depths {tuple(rst_depths)} must be deeper than rst_rounds {rst_rounds}")
    taken = list(instructions(avoid))
    out = {}
    for split, n, kw in (("val", n_val, {}), ("test", n_test, {}), ("test_deep", n_deep, dict(rst_depths=rst_depths)),
                         ("test_names", n_names, dict(vocab="unseen"))):
        out[split] = generate_tasks(os.path.join(out_dir, split), 0, n, seed, workers=workers, rst_rounds=rst_rounds,
                                    expert_text=expert_text, heldout_split=split, avoid=taken, scripted=scripted,
                                    **kw)[1] if n else []
        taken += instructions(out[split])
    return out


def pool_scale(task_dirs, q: float = 0.9) -> int:
    """S of r = P / S by the paper's rule on this pool: the q-quantile (nearest rank) of its tasks' assertion counts
    (paper: S = 20, about the 90th percentile of T1-15k's, median 4, max ~35). Every task must carry its count."""
    counts = []
    for d in task_dirs:
        n = task_io.load_task(d).n_assertions
        if n is None:
            raise ValueError(f"{d}: no assertion count (task.toml [metadata] n_assertions or {task_io.AUDIT_FILE}): "
                             "S cannot be set from the pool")
        counts.append(n)
    if not counts or not 0 < q <= 1:
        raise ValueError(f"pool_scale: need a non-empty pool and q in (0, 1], got {len(counts)} tasks, q {q}")
    return sorted(counts)[math.ceil(q * len(counts)) - 1]


def ordered_pool(task_dirs, n=None):
    """Quality-ordered pool (paper: T1-15k is the audit-score-ordered top of the synthesized set)."""
    q = {d: float(task_io.load_task(d).config.get("metadata", {}).get("quality", 0.0)) for d in task_dirs}
    pool = sorted(task_dirs, key=lambda d: (-q[d], os.path.basename(d)))
    return pool[:n] if n is not None else pool


def epoch_order(pool, epoch, seed):
    """The pool reshuffled for one epoch (deterministic in seed and epoch)."""
    order = list(pool)
    random.Random(f"{seed}/epoch/{epoch}").shuffle(order)
    return order


def launch_tasks(pool: list, step: int, n_launch: int, seed: int, per_task: int = 1) -> list:
    """The tasks of RL step `step` (1-based): the next n_launch of the stream epoch_order(0) + epoch_order(1) + ...
    (the pool reshuffled per epoch), so each epoch launches every task of the pool exactly once; each task is
    launched per_task times in a row (the paper: 1; a GRPO group: G). A step that crosses an epoch's end takes the
    rest of that epoch and the start of the next: every step launches n_launch * per_task (the oversampling ratio
    n_keep / n_launch stays the paper's), none is short."""
    if not pool or n_launch < 1 or step < 1 or per_task < 1:
        raise ValueError(f"launch_tasks: need a non-empty pool, n_launch >= 1, step >= 1 and per_task >= 1, got "
                         f"{len(pool)} tasks, n_launch {n_launch}, step {step}, per_task {per_task}")
    orders = {}
    out = []
    for i in range((step - 1) * n_launch, step * n_launch):  # positions in the stream
        epoch, pos = divmod(i, len(pool))
        if epoch not in orders:
            orders[epoch] = epoch_order(pool, epoch, seed)  # reshuffled per epoch
        out += [orders[epoch][pos]] * per_task
    return out


def corpus(task_dirs):
    """Texts for the tokenizer: instructions, expert replies (as the harness serialises them),
    the commands and typical terminal output (file names, file contents)."""
    texts = []
    for d in task_dirs:
        t = task_io.load_task(d)
        texts.append(t.instruction)
        sol = os.path.join(d, "solution", "terminus2.json")
        if os.path.isfile(sol):
            with open(sol) as f:
                for reply in json.load(f):
                    texts.append(json.dumps(reply))
                    texts += [f"root@sandbox:/app# {c['keystrokes']}" for c in reply["commands"]]
        app = os.path.join(t.env_dir, "app")
        for root, _, files in os.walk(app):
            for fn in sorted(files):
                rel = os.path.relpath(os.path.join(root, fn), app)
                texts.append(rel)
                if not fn.endswith(".gz"):
                    with open(os.path.join(root, fn), errors="replace") as f:
                        texts.append(f.read(400))
    return texts


COPY_ITEMS = (3, 8)  # items per copy sample (this project's)
# longest piece copied (this project's): nested paths such as a_data/b/c.txt are longer and left out; a base phase
# with 64 (paths in) read held-out .44 after SFT against .607, within the SFT seed spread (results/LOG.md, 2026-12-01)
COPY_ITEM_CHARS = 24


def copy_items(texts, max_chars: int = COPY_ITEM_CHARS) -> list:
    """The base phase's inventory: the distinct whitespace-separated pieces of the corpus (names, numbers, words,
    command fragments, paths such as a_data/b/c.txt), shorter than max_chars."""
    return sorted({w for t in texts for w in t.split() if len(w) < max_chars})


def copy_samples(tok, items: list, n: int, seed: int, names=(), share: float = 0.0) -> list[dict]:
    """n synthetic copy samples for the base phase (train_t1.base_phase) and the copy gate (experiments/bench.py copy),
    in the trainer's sample format: a user message "list: x1 .. xk" and the assistant's reply "copy: x1 .. xk" (k in
    COPY_ITEMS, x drawn from `items`), loss on the reply; copy_from = the first token of the copied items.
    The skill a held-out task needs (its names and numbers copied from the instruction into commands), taught
    on its own: without it the embedded model copied at chance (results/LOG.md). share > 0: each item is drawn from
    `names` (tasks/copying.random_names: strings no corpus holds) with that probability, else from items."""
    if not items or n < 1 or not 0 <= share <= 1 or (share and not names):
        raise ValueError(f"copy_samples: need items, n >= 1 and names for a share in [0, 1], got {len(items)} items, "
                         f"n {n}, {len(names)} names, share {share}")
    rng = random.Random(f"copy/{seed}")
    gen = tok.encode(ASSISTANT_PREFIX, add_special_tokens=False)
    cue = tok.encode("copy:", add_special_tokens=False)
    im_end = tok.convert_tokens_to_ids(IM_END)
    out = []
    for i in range(n):
        xs = " ".join(rng.choice(names if share and rng.random() < share else items)  # share 0: no draw for it
                      for _ in range(rng.randint(*COPY_ITEMS)))
        prompt = model.render_ids(tok, "user", "list: " + xs) + gen + cue
        reply = tok.encode(" " + xs, add_special_tokens=False) + [im_end]
        mask = [0] * (len(prompt) - len(cue)) + [1] * (len(cue) + len(reply))  # "copy:" is part of the reply
        out.append(dict(tokens=prompt + reply, loss_mask=mask, rollout_logprobs=[0.0] * len(mask), reward=0.0,
                        reward_source="none", passed=0, task=f"copy-{i}", copy_from=len(prompt)))
    return out


def audit_dirs(dirs, judge_url=None, judge_rounds=rst.JUDGE_ROUNDS, model_name="t1", workers=2):
    """`python data.py audit`: the mechanical audit (validate + rst.audit in fresh sandboxes) of task dirs and, with
    judge_url, the LLM judge's semantic audit (rst.judge): the verdict is the worse of the two (a judge without a
    parsable reply rejects as judge_failed), quality the lower. Returns the rows and rst.audit_stats of them."""
    work = tempfile.mkdtemp(prefix="t1_audit_")

    def one(d):
        t = time.time()
        fam = task_io.load_task(d).config.get("metadata", {}).get("family", "other")
        reason, ref = _validate(d, None, work)
        row = (dict(family=fam, verdict="rejected", reason=reason) if reason is not None
               else dict(rst.audit(d, work, reference=ref), family=fam))
        if judge_url and row["verdict"] != "rejected":
            j = rst.judge(d, judge_url, judge_rounds, model_name)
            order = {"accepted": 0, "borderline": 1, "rejected": 2, "judge_failed": 2}
            row["judge"], row["repaired"] = j, j["repaired"]
            if order[j["verdict"]] > order[row["verdict"]]:
                row["verdict"] = "rejected" if j["verdict"] == "judge_failed" else j["verdict"]
                row["reason"] = j["reason"] or f"low_quality: judge {j['quality']}"
            if j["quality"] is not None:
                row["quality"] = min(row["quality"], j["quality"])
        if row["verdict"] == "rejected" and not row.get("reason"):
            row["reason"] = f"low_quality: {row.get('quality')} < {rst.BORDERLINE}"
        return dict(row, task=os.path.basename(d), seconds=round(time.time() - t, 2))
    try:
        with cf.ThreadPoolExecutor(workers) as pool:
            rows = list(pool.map(one, dirs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows, rst.audit_stats(rows)


def task_dirs_under(paths) -> list:
    """Task dirs named directly, or the task dirs one level below a folder (a pool: DIR/train, DIR/heldout)."""
    out = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "task.toml")):
            out.append(p)
        elif os.path.isdir(p):
            out += sorted(os.path.join(p, n) for n in os.listdir(p) if os.path.isfile(os.path.join(p, n, "task.toml")))
        else:
            raise ValueError(f"{p}: not a task dir nor a folder of task dirs")
    if not out:
        raise ValueError(f"no task dir (with task.toml) in {list(paths)}")
    return out


def main(a) -> int:
    """generate: the pools and their audit statistics, then one JSON line; audit: one JSON line per task dir."""
    if a.cmd == "audit":
        rows, stats = audit_dirs(task_dirs_under(a.dirs), a.judge, a.judge_rounds, a.model, a.workers)
        for r in rows:
            print(json.dumps({k: r.get(k) for k in ("task", "verdict", "reason", "quality")}))
        print("\n".join(rst.format_stats(stats)))
        return 0
    generate_tasks(a.out, a.n_train, a.n_heldout, a.seed, validate_tasks=not a.no_validate,
                   scripted=not a.no_scripted, workers=a.workers, rst_rounds=a.rst_rounds)
    with open(os.path.join(a.out, "summary.json")) as f:
        summary = json.load(f)
    if summary["validated"]:  # like the paper's: accepted 5,902 / borderline 3,251 / rejected 5,847, 6,875 repaired
        print("\n".join(rst.format_stats(summary["audit"])))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGV))
