"""Task synthesis and audit in Harbor's task format (T1 paper, section "data").

Paper (T1, arXiv 2609.11042): recursive task synthesis (RST) from verified seed tasks, every reference solution
run in a fresh sandbox, then a five-stage, 15-round LLM audit over eight weighted dimensions that hard-rejects
hidden requirements, test leakage, solution shortcuts and weak verifiers; the accepted tasks, ordered by quality,
form T1-15k, reshuffled every epoch. Each task's verifier writes the CTRF report behind r = P/S (reward.py).

Run:
    python data.py generate --out runs/tasks --n-train 120 --n-heldout 30 --seed 0 [--rst-rounds 2]
        # writes DIR/train/<task>/, DIR/heldout/<task>/, DIR/summary.json; prints the audit statistics
        # (accepted / borderline / rejected per reason and family), then one JSON line
    rst.audit(task_dir)  # the four hard rejects and the eight-dimension quality score: rst.py
    task_io.load_task(dir), task_io.image_needs(task)  # reading a task dir and what the jail cannot run: task_io.py
    copy_samples(tok, copy_items(corpus(dirs)), n, seed)  # the embedded base phase's synthetic copy data

A task dir (Harbor): task.toml ([metadata] family, difficulty, split, quality, audit (the verdict), n_assertions;
[verifier] and [agent] timeout_sec; [environment]), instruction.md, environment/ (Dockerfile, app/ = the initial /app),
tests/test.sh + tests/test_outputs.py, solution/solve.sh and solution/terminus2.json (the expert's replies for SFT).
n_assertions is the task's own assertion count (reward.compute refuses a report with more tests): task.toml for
generated tasks, else the oracle's count in t1_audit.json (a task.toml this project did not write is never rewritten).

Departures from the paper:
1. No LLM: 6 templated families of real shell work (files/dirs, text processing, permissions, archives, CSV/JSON,
   find-then-act) with randomised parameters are the seeds; RST's recursive rewriting (rst_extend, --rst-rounds)
   extends a seed's path by operations from a fixed library (RST_OPS) and appends the step to the instruction
   ("... Then <step>.") instead of an LLM composing and rewriting; the files family has no file output to extend.
2. The audit is mechanical: validate() (the oracle resolves with reward == total/S and total == n_assertions, nop
   scores below full, the scripted expert resolves), then rst.audit's rule-based hard rejects, not an LLM's.
3. `quality` is rst.audit's weighted score (task.toml, with the verdict); a draft rejected by either is redrawn,
   never repaired. With --no-validate it stays a heuristic (assertion count + family difficulty).
4. Instructions and expert replies are short and formulaic: the embedded policy is a ~2.5M parameter model trained
   from scratch on CPU.
5. Train and held-out pools share families and vocabularies but never an instruction (different parameter draws);
   the split is recorded in task.toml.
"""
import argparse
import collections
import concurrent.futures as cf
import gzip
import io
import json
import math
import os
import random
import re
import shutil
import tarfile
import tempfile
import time

import model
import reward
import rollout
import rst
import task_io

SCALE = reward.SCALE  # S of r = P/S, one source (reward.py); a resolved oracle must score total/S

WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
         "juniper", "kestrel", "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven",
         "sable", "tundra", "umber", "velvet", "willow", "yarrow", "zephyr", "birch", "comet",
         "dune", "fjord", "grove"]
COLORS = ["red", "blue", "green", "black", "white", "amber", "olive", "coral", "ivory", "teal"]
PEOPLE = ["ana", "ben", "cara", "dan", "eve", "finn", "gia", "hugo", "ines", "jon", "kai", "lea",
          "mia", "noah", "omar", "pia", "raj", "sara", "tom", "uma", "vera", "will", "zoe"]
CITIES = ["oslo", "lima", "rome", "kyiv", "doha", "nice", "bern", "riga", "turin", "porto"]
LEVELS = ["ERROR", "WARN", "INFO", "DEBUG"]

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
DIFFICULTY = {"files": "easy", "text": "easy", "perms": "easy", "archive": "easy",
              "csvjson": "medium", "find": "medium"}


# --- helpers for the families -----------------------------------------------------------------
def _names(rng, k, ext, pool=WORDS):
    """k distinct names like maple42.txt."""
    out = []
    while len(out) < k:
        n = f"{rng.choice(pool)}{rng.randint(10, 99)}" + (f".{ext}" if ext else "")
        if n not in out:
            out.append(n)
    return out


def _text(rng, n_lines, words=WORDS, per_line=(3, 6)):
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(*per_line))) + "\n"
                   for _ in range(n_lines))


def _turn(analysis, plan, cmds):
    return dict(analysis=analysis, plan=plan, cmds=cmds)


def _spec(instruction, files, tests, turns, done, outputs):
    """A family's output: app files {relpath: str|bytes}, tests [(name, [lines])], expert turns
    (the solution is their commands), final analysis, outputs the tests read (named in the text)."""
    return dict(instruction=instruction, files=files, tests=tests, turns=turns, done=done,
                outputs=outputs)


def _tgz(members):
    """Deterministic .tar.gz bytes of {name: text}."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1700000000
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


# --- families (each: rng -> spec) ---------------------------------------------------------------
def fam_files(rng):
    d = _names(rng, 1, "")[0] + "_dir"
    f1, f2, f3, f4 = _names(rng, 4, "txt")
    body = {f: f"{rng.choice(WORDS)} {rng.randint(100, 999)}\n" for f in (f1, f2, f3, f4)}
    op = rng.choice(["move", "copy"])
    tool = "mv" if op == "move" else "cp"

    def placed(f):
        rest = f"not os.path.exists(A + '/{f}')" if op == "move" else f"_read({f!r}) == {body[f]!r}"
        return [f"assert _read('{d}/{f}') == {body[f]!r}", f"assert {rest}"]
    tests = [("dir_created", [f"assert os.path.isdir(A + '/{d}')"]),
             (f"first_file_{op}d", placed(f1)), (f"second_file_{op}d", placed(f2)),
             ("file_deleted", [f"assert not os.path.exists(A + '/{f3}')",
                               f"assert _read({f4!r}) == {body[f4]!r}"])]
    turns = [_turn(f"I am in /app. I need to {op} {f1} and {f2} into {d} and delete {f3}.",
                   f"Create {d}, {op} the two files, remove {f3}.",
                   [f"mkdir {d}", f"{tool} {f1} {f2} {d}/", f"rm {f3}", f"ls {d}"])]
    ins = f"In /app, create the directory {d}, {op} {f1} and {f2} into it, and delete {f3}."
    return _spec(ins, body, tests, turns, f"{f1} and {f2} are in {d} and {f3} is gone.", [d])


def fam_text(rng):
    kind = rng.choice(["count", "uniq", "replace", "sum", "words"])
    src, out = _names(rng, 2, "txt")
    if kind == "count":
        src = src[:-4] + ".log"
        lines = [f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)} {rng.choice(LEVELS)} "
                 f"{rng.choice(WORDS)} {rng.randint(1, 99)}" for _ in range(rng.randint(8, 16))]
        level = rng.choice(sorted({ln.split()[1] for ln in lines}))  # >= 1 match: grep -c exits 0
        n = sum(level in ln for ln in lines)
        files, cmd = {src: "\n".join(lines) + "\n"}, f"grep -c {level} {src} > {out}"
        ins = f"Count the lines in {src} that contain {level} and write the number to {out}."
        checks = [("count_correct", [f"assert int(_read({out!r}).strip()) == {n}"])]
        done = f"{out} holds the count {n}."
    elif kind == "uniq":
        pool = rng.sample(WORDS, rng.randint(4, 7))
        words = [rng.choice(pool) for _ in range(rng.randint(10, 18))]
        files, cmd = {src: "\n".join(words) + "\n"}, f"sort -u {src} > {out}"
        ins = f"Write the unique lines of {src}, sorted, to {out}."
        checks = [("lines_sorted", [f"assert _lines({out!r}) == sorted(_lines({out!r}))"]),
                  ("lines_unique", [f"ls = _lines({out!r})", "assert len(ls) == len(set(ls))"]),
                  ("same_words", [f"assert set(_lines({out!r})) == {set(words)!r}"])]
        done = f"{out} has the {len(set(words))} unique lines in order."
    elif kind == "replace":
        old, new = rng.choice(WORDS), rng.choice(COLORS)
        content = _text(rng, rng.randint(5, 9))
        while old not in content:
            content += f"{old} {rng.choice(WORDS)}\n"
        want = content.replace(old, new)  # what sed 's/old/new/g' writes (literal words)
        files, cmd = {src: content}, f"sed 's/{old}/{new}/g' {src} > {out}"
        ins = f"Replace every {old} with {new} in {src} and save the result as {out}."
        checks = [("old_word_gone", [f"assert {old!r} not in _read({out!r})"]),
                  ("new_word_count", [f"assert _read({out!r}).count({new!r}) == {want.count(new)}"]),
                  ("line_count_kept", [f"assert len(_lines({out!r})) == {len(want.splitlines())}"]),
                  ("content_exact", [f"assert _read({out!r}) == {want!r}"])]
        done = f"{out} has every {old} replaced by {new}."
    elif kind == "sum":
        col = rng.choice([2, 3])
        rows = [[rng.choice(PEOPLE), rng.randint(1, 50), rng.randint(1, 50)] for _ in range(rng.randint(4, 9))]
        total = sum(r[col - 1] for r in rows)
        files = {src: "".join(f"{a} {b} {c}\n" for a, b, c in rows)}
        cmd = f"awk '{{s+=${col}}} END {{print s}}' {src} > {out}"
        ins = f"Sum the numbers in column {col} of {src} and write the total to {out}."
        checks = [("total_correct", [f"assert int(_read({out!r}).strip()) == {total}"])]
        done = f"{out} holds the total {total}."
    else:
        content = _text(rng, rng.randint(3, 7))
        n = len(content.split())
        files, cmd = {src: content}, f"wc -w < {src} > {out}"
        ins = f"Write the number of words in {src} to {out}."
        checks = [("count_correct", [f"assert int(_read({out!r}).strip()) == {n}"])]
        done = f"{out} holds the word count {n}."
    tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
             ("output_nonempty", [f"assert _read({out!r}).strip()"])] + checks
    if len(tests) < 4:
        tests.append(("source_kept", [f"assert os.path.isfile(A + '/{out}')",
                                      f"assert _read({src!r}) == {files[src]!r}"]))
    verb = dict(count="count lines in", uniq="sort the lines of", replace="replace a word in", sum="sum a column of",
                words="count the words in")[kind]
    turns = [_turn(f"I am in /app and need to {verb} {src}.", f"Run one command and check {out}.",
                   [cmd, f"cat {out}"])]
    return _spec(ins, files, tests, turns, done, [out])


def fam_perms(rng):
    if rng.random() < 0.4:  # write a script and make it executable
        s = _names(rng, 1, "sh")[0]
        w = f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
        tests = [("script_exists", [f"assert os.path.isfile(A + '/{s}')"]),
                 ("script_executable", [f"assert _mode({s!r}) & stat.S_IXUSR"]),
                 ("script_prints_word", [f"r = subprocess.run([A + '/{s}'], capture_output=True, text=True, "
                                         "timeout=10)",
                                         f"assert r.stdout.strip() == {w!r}"])]
        turns = [_turn(f"I need a script {s} in /app that prints {w}.", "Write it with printf, then chmod +x.",
                       [f"printf '#!/bin/sh\\necho {w}\\n' > {s}", f"chmod +x {s}", f"./{s}"])]
        ins = f"Create the script {s} in /app that prints {w}, and make it executable."
        return _spec(ins, {}, tests, turns, f"{s} prints {w}.", [s])
    s = _names(rng, 1, "sh")[0]
    k, = _names(rng, 1, "key")
    d = _names(rng, 1, "")[0] + "_private"
    w = f"hello {rng.choice(WORDS)}"
    km, dm = rng.choice(["600", "640", "400"]), rng.choice(["700", "750", "711"])
    files = {s: f"#!/bin/sh\necho {w}\n", k: f"secret-{rng.randint(1000, 9999)}\n"}
    tests = [("script_executable", [f"assert _mode({s!r}) & stat.S_IXUSR"]),
             ("script_runs", [f"r = subprocess.run([A + '/{s}'], capture_output=True, text=True, timeout=10)",
                              f"assert r.stdout.strip() == {w!r}"]),
             ("key_mode", [f"assert _mode({k!r}) == 0o{km}"]),
             ("dir_created", [f"assert os.path.isdir(A + '/{d}')"]),
             ("dir_mode", [f"assert _mode({d!r}) == 0o{dm}"])]
    turns = [_turn(f"I need to fix permissions in /app: {s}, {k} and a new dir {d}.",
                   "Use chmod and mkdir -m, then list the modes.",
                   [f"chmod +x {s}", f"chmod {km} {k}", f"mkdir -m {dm} {d}", "ls -l"])]
    ins = f"In /app, make {s} executable, set {k} to mode {km}, and create the directory {d} with mode {dm}."
    return _spec(ins, files, tests, turns, f"Modes are set: {s} +x, {k} {km}, {d} {dm}.", [s, k, d])


def fam_archive(rng):
    kind = rng.choice(["create", "extract", "gzip"])
    members = {f: f"{rng.choice(WORDS)} {rng.randint(100, 999)}\n" for f in _names(rng, rng.randint(2, 3), "txt")}
    first = sorted(members)[0]
    a = _names(rng, 1, "")[0]
    if kind == "create":
        d = _names(rng, 1, "")[0] + "_docs"
        path = f"A + '/{a}.tar.gz'"
        names = f"[n.lstrip('./') for n in tarfile.open({path}, 'r:gz').getnames()]"
        tests = [("archive_exists", [f"assert os.path.isfile({path})"]),
                 ("archive_is_tar_gz", [f"assert tarfile.open({path}, 'r:gz').getnames()"]),
                 ("archive_has_files", [f"assert {sorted(d + '/' + f for f in members)!r} == "
                                        f"sorted(n for n in {names} if n.endswith('.txt'))"]),
                 ("member_content", [f"t = tarfile.open({path}, 'r:gz')",
                                     f"m = [n for n in t.getnames() if n.endswith('{d}/{first}')][0]",
                                     f"assert t.extractfile(m).read().decode() == {members[first]!r}"])]
        turns = [_turn(f"I need to pack the directory {d} into {a}.tar.gz.", "Use tar -czf and list it.",
                       [f"tar -czf {a}.tar.gz {d}", f"tar -tzf {a}.tar.gz"])]
        ins = f"Create the archive {a}.tar.gz in /app containing the directory {d}."
        files = {f"{d}/{f}": t for f, t in members.items()}
        return _spec(ins, files, tests, turns, f"{a}.tar.gz holds {d}.", [f"{a}.tar.gz"])
    if kind == "extract":
        out = _names(rng, 1, "")[0] + "_files"
        tests = [("dir_created", [f"assert os.path.isdir(A + '/{out}')"])]
        tests += [(f"extracted_{i}", [f"assert _read('{out}/{f}') == {t!r}"])
                  for i, (f, t) in enumerate(sorted(members.items()))]
        turns = [_turn(f"I need to unpack {a}.tar.gz into a new directory {out}.", "Make the dir, extract with -C.",
                       [f"mkdir {out}", f"tar -xzf {a}.tar.gz -C {out}", f"ls {out}"])]
        ins = f"Extract {a}.tar.gz into the new directory {out} in /app."
        return _spec(ins, {f"{a}.tar.gz": _tgz(members)}, tests, turns, f"{out} holds the files.", [out])
    text = _text(rng, rng.randint(4, 8))
    f = a + ".txt"
    tests = [("gz_exists", [f"assert os.path.isfile(A + '/{f}.gz')"]),
             ("gz_content", [f"assert gzip.open(A + '/{f}.gz').read().decode() == {text!r}"]),
             ("original_kept", [f"assert os.path.isfile(A + '/{f}.gz')", f"assert _read({f!r}) == {text!r}"])]
    turns = [_turn(f"I need to gzip {f} and keep the original.", "Use gzip -k.", [f"gzip -k {f}", "ls"])]
    ins = f"Compress {f} in /app with gzip and keep the original file."
    return _spec(ins, {f: text}, tests, turns, f"{f}.gz exists and {f} is kept.", [f"{f}.gz"])


def fam_csvjson(rng):
    kind = rng.choice(["filter", "sum", "jsonmax", "jsonlist"])
    out, = _names(rng, 1, "txt")
    num = rng.choice(["age", "score", "points"])
    people = rng.sample(PEOPLE, rng.randint(5, 9))
    vals = rng.sample(range(10, 90), len(people))
    rows = [dict(name=p, **{num: v}, city=rng.choice(CITIES)) for p, v in zip(people, vals)]
    if kind in ("filter", "sum"):
        csv, = _names(rng, 1, "csv")
        cols = ["name"] + rng.sample([num, "city"], 2)
        k = cols.index(num) + 1
        files = {csv: ",".join(cols) + "\n" + "".join(",".join(str(r[c]) for c in cols) + "\n" for r in rows)}
        look = _turn(f"I need the {num} column of {csv}; first I read the header.", f"Show the top of {csv}.",
                     [f"head -3 {csv}"])
        if kind == "filter":
            n = sorted(vals)[rng.randint(1, len(vals) - 2)]
            want = [r["name"] for r in rows if r[num] > n]
            tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                     ("no_header", [f"assert _lines({out!r}) and 'name' not in _lines({out!r})"]),
                     ("right_names", [f"assert set(_lines({out!r})) == {set(want)!r}"]),
                     ("file_order", [f"assert _lines({out!r}) == {want!r}"])]
            cmd = f"awk -F, 'NR>1 && ${k}>{n} {{print $1}}' {csv} > {out}"
            ins = f"Write the names in {csv} whose {num} is greater than {n} to {out}, one per line."
            done = f"{out} lists the matching names."
        else:
            tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                     ("output_number", [f"assert _read({out!r}).strip().isdigit()"]),
                     ("sum_correct", [f"assert int(_read({out!r}).strip()) == {sum(vals)}"])]
            cmd = f"awk -F, 'NR>1 {{s+=${k}}} END {{print s}}' {csv} > {out}"
            ins = f"Write the sum of the {num} column of {csv} to {out}."
            done = f"{out} holds the sum {sum(vals)}."
        act = _turn(f"The header shows {num} is column {k}.", "Use awk on that column.", [cmd, f"cat {out}"])
        return _spec(ins, files, tests, [look, act], done, [out])
    js, = _names(rng, 1, "json")
    files = {js: json.dumps(rows, indent=2) + "\n"}
    if kind == "jsonmax":
        best = max(rows, key=lambda r: r[num])["name"]
        tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                 ("one_line", [f"assert len(_lines({out!r})) == 1"]),
                 ("best_name", [f"assert _read({out!r}).strip() == {best!r}"])]
        cmd = f"jq -r 'max_by(.{num}).name' {js} > {out}"
        ins = f"Write the name with the highest {num} in {js} to {out}."
        done = f"{out} holds {best}."
    else:
        field = rng.choice(["name", "city", num])
        want = [str(r[field]) for r in rows]
        tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                 ("line_count", [f"assert len(_lines({out!r})) == {len(want)}"]),
                 ("values_in_order", [f"assert _lines({out!r}) == {want!r}"])]
        cmd = f"jq -r '.[].{field}' {js} > {out}"
        ins = f"Write the {field} of every entry in {js} to {out}, one per line."
        done = f"{out} has {len(want)} lines."
    turns = [_turn(f"{js} is a JSON list of objects.", "Use jq and check the output.", [cmd, f"cat {out}"])]
    return _spec(ins, files, tests, turns, done, [out])


def fam_find(rng):
    kind = rng.choice(["grep", "name", "largest"])
    d = _names(rng, 1, "")[0] + "_data"
    subs = _names(rng, 3, "")
    paths = [f"{d}/{rng.choice(subs)}/{f}" for f in _names(rng, rng.randint(4, 6), "txt")]
    files = {p: _text(rng, rng.randint(2, 5)) for p in paths}
    target = rng.choice(paths)
    if kind == "grep":
        out, = _names(rng, 1, "txt")
        w = f"{rng.choice(WORDS).upper()}{rng.randint(100, 999)}"
        files[target] += f"{rng.choice(WORDS)} {w}\n"
        tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                 ("has_word", [f"assert {w!r} in _read({out!r})"]),
                 ("same_content", [f"assert _read({out!r}) == {files[target]!r}"]),
                 ("source_kept", [f"assert os.path.isfile(A + '/{out}')",
                                  f"assert _read({target!r}) == {files[target]!r}"])]
        turns = [_turn(f"I must find which file under {d} has {w}.", f"grep -rl {w} in {d}.", [f"grep -rl {w} {d}"]),
                 _turn(f"grep found {target}.", f"Copy it to {out}.", [f"cp {target} {out}", f"cat {out}"])]
        ins = f"One file under {d} contains the word {w}. Copy that file to {out} in /app."
        return _spec(ins, files, tests, turns, f"{out} is a copy of {target}.", [out])
    base = target.rsplit("/", 1)[1]
    if kind == "name":
        tests = [("file_in_app", [f"assert os.path.isfile(A + '/{base}')"]),
                 ("same_content", [f"assert _read({base!r}) == {files[target]!r}"]),
                 ("moved_not_copied", [f"assert os.path.isfile(A + '/{base}')",
                                       f"assert not os.path.exists(A + '/{target}')"])]
        turns = [_turn(f"I must find {base} under {d}.", "Use find -name.", [f"find {d} -name {base}"]),
                 _turn(f"find shows {target}.", "Move it to /app.", [f"mv {target} .", "ls"])]
        ins = f"Find the file named {base} under {d} and move it to /app."
        return _spec(ins, files, tests, turns, f"{base} is now in /app.", [base])
    out, = _names(rng, 1, "txt")
    flat = {f"{d}/{p.rsplit('/', 1)[1]}": t for p, t in files.items()}  # one level: ls -S is enough
    big = rng.choice(sorted(flat))
    flat[big] += _text(rng, 12)  # clearly the largest
    others = sorted(p for p in flat if p != big)
    tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
             ("largest_content", [f"assert _read({out!r}) == {flat[big]!r}"]),
             ("moved_not_copied", [f"assert os.path.isfile(A + '/{out}')", f"assert not os.path.exists(A + '/{big}')"]),
             ("others_kept", [f"assert os.path.isfile(A + '/{out}')"]
              + [f"assert os.path.isfile(A + '/{p}')" for p in others])]
    turns = [_turn(f"I must find the largest file in {d}.", "List it sorted by size.", [f"ls -S {d}"]),
             _turn(f"ls -S shows {big.rsplit('/', 1)[1]} first.", f"Move it to {out}.", [f"mv {big} {out}", "ls"])]
    ins = f"Move the largest file in {d} to {out} in /app."
    return _spec(ins, flat, tests, turns, f"{out} is the largest file from {d}.", [out])


FAMILIES = {"files": fam_files, "text": fam_text, "perms": fam_perms, "archive": fam_archive,
            "csvjson": fam_csvjson, "find": fam_find}




# --- RST: recursive task synthesis (extend the executable path, then rewrite the instruction) -------------------
def _op_backup(rng, o, fam):
    d = _names(rng, 1, "")[0] + "_backup"
    b = os.path.basename(o)
    return (f"copy {o} into the new directory {d}", [f"mkdir {d}", f"cp {o} {d}/"],
            [(f"backup_dir_{d}", [f"assert os.path.isdir(A + '/{d}')"]),
             (f"backup_copy_{d}", [f"assert _bytes('{d}/{b}') == _bytes({o!r})"])], [d])


def _op_gzip(rng, o, fam):
    return (f"compress {o} with gzip into {o}.gz, keeping {o}", [f"gzip -k {o}"],
            [(f"gzip_of_{o}", [f"assert gzip.open(A + '/{o}.gz').read() == _bytes({o!r})"])], [f"{o}.gz"])


def _op_count(rng, o, fam):
    c, = _names(rng, 1, "txt")
    return (f"write the number of lines of {o} to {c}", [f"wc -l < {o} > {c}"],
            [(f"line_count_{c}", [f"assert int(_read({c!r}).strip()) == len(_lines({o!r}))"])], [c])


def _op_readonly(rng, o, fam):
    return (f"make {o} read-only for everyone (mode 444)", [f"chmod 444 {o}"],
            [(f"read_only_{o}", [f"assert _mode({o!r}) == 0o444"])], [])


# the library of verified operations on one output file: (name, op, applies to (output, family))
RST_OPS = (("backup", _op_backup, lambda o, fam: True),
           ("gzip", _op_gzip, lambda o, fam: not o.endswith(".gz")),
           ("count", _op_count, lambda o, fam: not o.endswith(".gz")),  # text files only
           ("readonly", _op_readonly, lambda o, fam: fam != "perms"))  # would undo the perms family's modes


def rst_extend(spec, family, rng, rounds):
    """RST at embedded scale: `rounds` times, extend the executable path by one operation from RST_OPS applied
    to an output file of the task so far (the newest first), then rewrite the instruction to ask for it ("...
    Then <step>."); the new step's commands become one more expert turn and its checks more tests. Every draft
    is verified by data.validate and rst.audit like any task (the oracle resolves; nop fails; a mutant without
    any one step fails a test: weak_verifier). Returns a new spec; the seed spec is not changed."""
    spec = dict(spec, tests=list(spec["tests"]), turns=list(spec["turns"]), outputs=list(spec["outputs"]))
    used = set()
    for _ in range(rounds):
        files = [o for o in reversed(spec["outputs"]) if "." in os.path.basename(o)]
        options = [(o, name, op) for o in files for name, op, ok in RST_OPS if ok(o, family) and (o, name) not in used
                   and (o, "readonly") not in used]  # read-only ends a file's steps (this project's choice)
        if not options:
            break
        o = files[0] if any(x[0] == files[0] for x in options) else options[0][0]
        o, name, op = rng.choice([x for x in options if x[0] == o])
        used.add((o, name))
        phrase, cmds, tests, outputs = op(rng, o, family)
        spec["instruction"] = f"{spec['instruction']} Then {phrase}."
        spec["tests"] += [(re.sub(r"\W", "_", n), lines) for n, lines in tests]  # test names: identifiers
        spec["turns"].append(_turn(f"Next I {phrase}.", f"Run {cmds[0].split()[0]}.", cmds))
        spec["outputs"] += outputs
        spec["done"] = f"{spec['done']} I also did: {phrase}."
    return spec


EXPERT_TEXTS = ("full", "terse")  # expert_replies' free text (train_t1 --expert-text)
TERSE = dict(analysis="Working on the task.", plan="Run the commands.", done="The task is done.")


def expert_replies(spec, text="full"):
    """Terminus-2 replies of the expert: the work turns, then task_complete twice (confirmation).

    text "full": each turn's analysis / plan restate the task's names and values (a teacher's prose); "terse": the
    same fixed words on every task (TERSE), so that the commands are the only task-specific tokens an SFT model
    learns to write (this project's choice, paper silent: its SFT transcripts are a teacher model's; measured:
    at T = 1 the tiny model's free text carries 92% of the policy gradient's variance and no signal, RESULTS.md)."""
    if text not in EXPERT_TEXTS:
        raise ValueError(f"expert_replies: text must be one of {EXPERT_TEXTS}, got {text!r}")
    terse = text == "terse"
    replies = [dict(analysis=TERSE["analysis"] if terse else t["analysis"], plan=TERSE["plan"] if terse else t["plan"],
                    commands=[dict(keystrokes=c + "\n", duration=0.1) for c in t["cmds"]], task_complete=False)
               for t in spec["turns"]]
    replies.append(dict(analysis=TERSE["done"] if terse else spec["done"], plan="The task is complete.", commands=[],
                        task_complete=True))
    replies.append(dict(analysis="I checked the result.", plan="Confirm completion.", commands=[], task_complete=True))
    return replies


def quality(family, n_tests):
    """Heuristic quality in [0, 1] before the audit (departure 3): more assertions and harder families first."""
    return round(min(1.0, 0.1 * n_tests + (0.4 if DIFFICULTY[family] == "medium" else 0.2)), 3)


def write_task(task_dir, spec, family, split, seed, expert_text="full"):
    """Write one Harbor task dir from a family spec (solution/terminus2.json: expert_replies(spec, expert_text))."""
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
    toml = (f'version = "1.0"\n\n[metadata]\nfamily = "{family}"\ndifficulty = "{DIFFICULTY[family]}"\n'
            f'split = "{split}"\nquality = {quality(family, n)}\nn_assertions = {n}\nseed = "{seed}"\n'
            f'author_name = "t1-repro data.py"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 300.0\n\n'
            f'[environment]\nbuild_timeout_sec = 600.0\ncpus = 1\nmemory_mb = 1024\n')
    body = TEST_HEADER + "".join(f"\n\ndef test_{name}():\n" + "".join(f"    {ln}\n" for ln in lines)
                                 for name, lines in spec["tests"])
    solve = "#!/bin/bash\nset -e\ncd /app\n" + "".join(c + "\n" for t in spec["turns"] for c in t["cmds"])
    out = {"task.toml": toml, "instruction.md": spec["instruction"] + "\n", "environment/Dockerfile": DOCKERFILE,
           "tests/test.sh": TEST_SH, "tests/test_outputs.py": body, "solution/solve.sh": solve,
           "solution/terminus2.json": json.dumps(expert_replies(spec, expert_text), indent=1) + "\n"}
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
        if any(rel == o or rel.startswith(o + "/") for rel in spec["files"]):
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
def _draw(split, slot, seed, seen, attempt=0, rst_rounds=0):
    """Deterministic spec for one slot of a split (family = slot mod 6), extended by rst_rounds RST steps,
    skipping instructions already used in either split and drafts that fail the static audit."""
    family = list(FAMILIES)[slot % len(FAMILIES)]
    first = attempt
    while True:
        rng = random.Random(f"{seed}/{split}/{slot}/{attempt}")
        spec = FAMILIES[family](rng)
        if rst_rounds:
            spec = rst_extend(spec, family, rng, rst_rounds)
        if spec["instruction"] not in seen and static_audit(spec) is None:
            seen.add(spec["instruction"])
            return family, spec, f"{seed}/{split}/{slot}/{attempt}"
        attempt += 1
        if attempt - first > 200:
            raise RuntimeError(f"cannot draw a new {family} task for {split} slot {slot}")


def generate_tasks(out_dir, n_train, n_heldout, seed, validate_tasks=True, scripted=True, workers=2, rst_rounds=0,
                   validate_train=True, expert_text="full"):
    """Write n_train + n_heldout audited tasks under out_dir/{train,heldout}/ (each seed task extended by
    rst_rounds RST steps: rst_extend; solution/terminus2.json's free text by expert_text: expert_replies).
    validate_train=False audits the held-out split alone (a large RL pool: the audit costs ~2.6 s a task here).

    Tasks failing validate() or rst.audit (hard reject, or quality under rst.BORDERLINE) are dropped and redrawn
    (up to 3 rounds); drops and the audit statistics are in out_dir/summary.json. Returns (train_dirs, heldout_dirs)."""
    t0 = time.time()
    seen = set()  # instructions of both splits: train and held-out never share one
    specs = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        for slot in range(n):
            family, spec, sd = _draw(split, slot, seed, seen, rst_rounds=rst_rounds)
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
            family, spec, sd = _draw(*key, seed, seen, attempt=1000 * (rnd + 1), rst_rounds=rst_rounds)
            d = os.path.join(out_dir, key[0], f"{key[0]}-{key[1]:04d}-{family}")
            specs[key] = pending[key] = write_task(d, spec, family, key[0], sd, expert_text)
        if not pending:
            break
    shutil.rmtree(work_root, ignore_errors=True)
    train = [specs[k] for k in sorted(specs) if k[0] == "train"]
    heldout = [specs[k] for k in sorted(specs) if k[0] == "heldout"]
    tasks = {d: task_io.load_task(d) for d in train + heldout}
    assert not {tasks[d].instruction for d in train} & {tasks[d].instruction for d in heldout}, "split overlap"
    n_asserts = [t.config["metadata"]["n_assertions"] for t in tasks.values()]
    summary = dict(train=len(train), heldout=len(heldout), seed=seed,
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


def overlap(train_dirs, heldout_dirs) -> dict:
    """How new the held-out tasks are to a training pool: shared instructions (0 by construction), held-out
    instruction words and reference command lines seen in the pool's, and held-out tasks whose every command
    line was seen (solvable by recall alone)."""
    def read(d):
        t = task_io.load_task(d)
        with open(os.path.join(d, "solution", "solve.sh")) as f:
            cmds = [ln for ln in f.read().splitlines()[3:] if ln.strip()]  # after the shebang, set -e, cd /app
        return t.instruction, cmds
    train = [read(d) for d in train_dirs]
    held = [read(d) for d in heldout_dirs]
    words = {w for ins, _ in train for w in ins.split()}
    lines = {c for _, cmds in train for c in cmds}
    hw = [w for ins, _ in held for w in ins.split()]
    hl = [c for _, cmds in held for c in cmds]
    return {"instructions_shared": len({i for i, _ in held} & {i for i, _ in train}),
            "word_seen": round(sum(w in words for w in hw) / max(1, len(hw)), 3),
            "command_line_seen": round(sum(c in lines for c in hl) / max(1, len(hl)), 3),
            "tasks_all_lines_seen": sum(all(c in lines for c in cmds) for _, cmds in held)}


COPY_ITEMS = (3, 8)  # items per copy sample (this project's)


def copy_items(texts) -> list:
    """The base phase's inventory: the distinct whitespace-separated pieces of the corpus (names, numbers, words,
    command fragments), under 24 characters."""
    return sorted({w for t in texts for w in t.split() if len(w) < 24})


def copy_samples(tok, items: list, n: int, seed: int) -> list[dict]:
    """n synthetic copy samples for the base phase (train_t1.base_phase) and the copy gate (bench.py copy), in the
    trainer's sample format: a user message "list: x1 .. xk" and the assistant's reply "copy: x1 .. xk" (k in
    COPY_ITEMS, x drawn from `items`), loss on the reply; copy_from = the first token of the copied items.
    The skill a held-out task needs (its names and numbers copied from the instruction into commands), taught
    on its own: issue 13 measured the embedded model copying at chance without it."""
    if not items or n < 1:
        raise ValueError(f"copy_samples: need items and n >= 1, got {len(items)} items, n {n}")
    rng = random.Random(f"copy/{seed}")
    gen = tok.encode(model.ASSISTANT_PREFIX, add_special_tokens=False)
    cue = tok.encode("copy:", add_special_tokens=False)
    im_end = tok.convert_tokens_to_ids(model.IM_END)
    out = []
    for i in range(n):
        xs = " ".join(rng.choice(items) for _ in range(rng.randint(*COPY_ITEMS)))
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="T1 task synthesis + audit (Harbor format)")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--out", required=True)
    g.add_argument("--n-train", type=int, default=120)
    g.add_argument("--n-heldout", type=int, default=30)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-validate", action="store_true", help="skip the sandbox audit")
    g.add_argument("--no-scripted", action="store_true", help="skip the scripted-trajectory check")
    g.add_argument("--workers", type=int, default=2)
    g.add_argument("--rst-rounds", type=int, default=0, help="RST steps added to each seed task (rst_extend)")
    au = sub.add_parser("audit", help="audit task dirs in fresh sandboxes; --judge URL adds the LLM's semantic audit")
    au.add_argument("dirs", nargs="+", help="task dirs, or folders of task dirs")
    au.add_argument("--judge", default=None, help="OpenAI-compatible endpoint (the project's gateway too)")
    au.add_argument("--judge-rounds", type=int, default=rst.JUDGE_ROUNDS, help="replies per task (paper: 15)")
    au.add_argument("--model", default="t1", help="the model name the endpoint expects")
    au.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    if a.cmd == "audit":
        rows, stats = audit_dirs(task_dirs_under(a.dirs), a.judge, a.judge_rounds, a.model, a.workers)
        for r in rows:
            print(json.dumps({k: r.get(k) for k in ("task", "verdict", "reason", "quality")}))
        print("\n".join(rst.format_stats(stats)))
        raise SystemExit(0)
    generate_tasks(a.out, a.n_train, a.n_heldout, a.seed, validate_tasks=not a.no_validate,
                   scripted=not a.no_scripted, workers=a.workers, rst_rounds=a.rst_rounds)
    with open(os.path.join(a.out, "summary.json")) as f:
        summary = json.load(f)
    if summary["validated"]:  # like the paper's: accepted 5,902 / borderline 3,251 / rejected 5,847, 6,875 repaired
        print("\n".join(rst.format_stats(summary["audit"])))
    print(json.dumps(summary))
