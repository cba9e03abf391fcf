"""The mechanical audit of synthesized tasks (T1 paper, section "data"): the four hard rejects and the quality score.

Paper: a five-stage, 15-round LLM audit scores every task on eight weighted dimensions and hard-rejects hidden
requirements, test leakage, solution shortcuts and weak verifiers (accepted 5,902 / borderline 3,251 / rejected
5,847; 6,875 instructions repaired). Here each reject is a rule run on a task dir (Harbor format) and in fresh
sandboxes: rollout.run_trial's oracle agent on a copy of the task whose solution/solve.sh is replaced.

Run (data.generate_tasks calls it after data.validate; `python data.py generate ...` prints the statistics):
    rst.audit(task_dir, work_root) -> dict(reason, reasons, verdict, quality, dims, seconds)
    python data.py audit runs/x/tasks/train [--judge http://127.0.0.1:8000 --judge-rounds 15 --model NAME]

The rules (a reason reads "<name>: why"; audit() lists every one that fires, in this order):
- hidden_requirement: every word (a run of >= 2 letters / digits, case kept) of every string literal inside a test
  function of tests/*.py occurs in instruction.md or in the initial environment/app tree (paths, file contents,
  names and contents of .gz / .tar.gz members). Numbers outside strings (counts, sums, modes) are the computed
  answers and are not checked.
- test_leakage: environment/ holds a file named like a tests/ or solution/ file, or a file holding an assert line
  of the tests or a command of solve.sh, or the Dockerfile copies tests/ or solution/; or a file the reference
  solution writes already has its content in instruction.md (as words) or in an initial file solve.sh never names.
- solution_shortcut: `true`, or creating every new path instruction.md names (empty file when the name has an
  extension, else a directory), passes every test. (nop scoring full is data.validate's "weak verifier".)
- weak_verifier: a mutant of solve.sh without one step passes every test although its final /app differs from
  the reference solution's. Not run: the shebang, comments, `set`, `cd` and read-only commands without a
  redirection (ls, cat, head, tail, grep, find, wc, pwd, echo, tar -t); a mutant that leaves /app as the
  reference leaves it skipped a no-op step (a script run to look at its output) and passes.

The eight dimensions (WEIGHTS, the paper's), each in [0, 1]: instruction_verifier_alignment = share of the tests'
words the agent can see; verifier_fairness = 1 when every shipped solution (solve.sh, the scripted expert) passes;
verifier_strength = 1 - the best trivial solution's share of passed tests; solution_correctness = the reference's
share; solution_necessity = share of steps whose mutant fails; instruction_clarity = share of the top-level paths
the solution changes that instruction.md names; instruction_no_leakage = 0 on leakage; task_value = half
min(1, tests / 8) + half min(1, steps / 4). quality = the weighted sum.

Departures from the paper:
1. Rules on words and files stand in for the LLM judge: a test that checks a word present somewhere in /app for the
   wrong reason passes hidden_requirement. The judge itself is optional (`python data.py audit --judge URL`:
   judge(), JUDGE_ROUNDS = 15 independent replies per task, a majority rejects; the paper's 5 stages are one rubric).
2. The eight dimensions are scored from what the rules measured (score_dims); the paper is silent on the
   accepted / borderline thresholds: ACCEPT and BORDERLINE are this project's.
3. No instruction is repaired (no LLM): a rejected slot is redrawn with new parameters by data.generate_tasks.
"""
import ast
import collections
import gzip
import io
import json
import os
import re
import shlex
import shutil
import tarfile
import tempfile
import time

import rollout
from engine.client import chat_completion
from sandbox import task_io

REASONS = ("hidden_requirement", "test_leakage", "solution_shortcut", "weak_verifier")
# paper's eight audit dimensions and weights; facets: Verifier 45%, Solution 25%, Instruction 20%, Task Value 10%
WEIGHTS = {"instruction_verifier_alignment": 0.20, "verifier_fairness": 0.15, "verifier_strength": 0.10,  # Verifier
           "solution_correctness": 0.15, "solution_necessity": 0.10,  # Solution
           "instruction_clarity": 0.10, "instruction_no_leakage": 0.10,  # Instruction
           "task_value": 0.10}  # Task Value
FACETS = {"verifier": ("instruction_verifier_alignment", "verifier_fairness", "verifier_strength"),
          "solution": ("solution_correctness", "solution_necessity"),
          "instruction": ("instruction_clarity", "instruction_no_leakage"), "task_value": ("task_value",)}
ACCEPT, BORDERLINE = 0.85, 0.70  # paper silent on thresholds: quality >= ACCEPT accepted, >= BORDERLINE borderline
READ_ONLY = {"ls", "cat", "head", "tail", "grep", "find", "wc", "pwd", "echo", "true", ":"}
SKIP_DIRS = {"__pycache__", ".pytest_cache"}  # written by the verifier's pytest, not by a solution
WORD = re.compile(r"[A-Za-z0-9]+")


def _words(text):
    return [w for w in WORD.findall(text) if len(w) >= 2]


# --- reading a task's trees -------------------------------------------------------------------------------
def _content(path):
    """Bytes of a file for comparison; a .gz (or .tar.gz) by what it holds, so timestamps inside do not count."""
    with open(path, "rb") as f:
        data = f.read()
    if not path.endswith(".gz"):
        return data
    try:
        raw = gzip.decompress(data)
    except (OSError, EOFError):
        return data
    try:
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            return repr(sorted((m.name.lstrip("./"), tar.extractfile(m).read() if m.isfile() else b"")
                               for m in tar.getmembers())).encode()
    except tarfile.TarError:
        return raw


def tree_state(app):
    """{relpath: (is_dir, mode, content)} of an /app tree (the verifier's pytest caches left out)."""
    out = {}
    for root, dirs, files in os.walk(app):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for n in dirs + sorted(files):
            p = os.path.join(root, n)
            st = os.lstat(p)
            is_dir = os.path.isdir(p) and not os.path.islink(p)
            out[os.path.relpath(p, app)] = (is_dir, st.st_mode & 0o7777, b"" if is_dir or os.path.islink(p)
                                            else _content(p))
    return out


def _env_text(task):
    """Everything the agent sees before verification: instruction.md and the initial /app (names, contents)."""
    parts = [task.instruction]
    for rel, (_, _, content) in tree_state(os.path.join(task.env_dir, "app")).items():
        parts += [rel, content.decode(errors="replace")]
    return "\n".join(parts)


def _test_literals(tests_dir):
    """String literals inside the test functions of the Python files in tests/ (test_outputs.py for ours)."""
    out = []
    for name in sorted(os.listdir(tests_dir)):
        if name.endswith(".py"):
            with open(os.path.join(tests_dir, name)) as f:
                tree = ast.parse(f.read())
            out += [n.value for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")
                    for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return out


def solve_steps(task):
    """[(line index, command)] of solution/solve.sh that change state (the no-op lines of the docstring left out)."""
    with open(os.path.join(task.solution_dir, "solve.sh")) as f:
        lines = f.read().splitlines()
    steps = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            argv = shlex.split(s)
        except ValueError:
            argv = s.split()
        head = argv[0] if argv else ""
        redirect = any(c in s for c in (">", "|", "-exec", "-delete"))
        listing = head == "tar" and "t" in (argv[1:] or [""])[0]  # tar -tzf: lists an archive
        if head in ("set", "cd") or (not redirect and (head in READ_ONLY or listing)):
            continue
        steps.append((i, s))
    return steps


# --- the four hard rejects --------------------------------------------------------------------------------
def hidden_requirement(task):
    """-> (reason or None, share of test words the agent can see)."""
    seen = set(_words(_env_text(task)))
    words = [w for lit in _test_literals(task.tests_dir) for w in _words(lit)]
    missing = sorted({w for w in words if w not in seen})
    share = 1.0 - sum(w in missing for w in words) / max(1, len(words))
    if missing:
        return f"hidden_requirement: the tests check {', '.join(missing[:5])}, named nowhere the agent looks", share
    return None, share


def test_leakage(task, initial, final):
    """initial / final: tree_state of /app before and after the reference solution."""
    with open(os.path.join(task.solution_dir, "solve.sh")) as f:
        solve = f.read()
    hidden = {}  # text of the files the agent must not see
    for d in (task.tests_dir, task.solution_dir):
        for n in sorted(os.listdir(d)):
            if os.path.isfile(os.path.join(d, n)):
                with open(os.path.join(d, n), errors="replace") as f:
                    hidden[n] = f.read()
    needles = [ln.strip() for ln in hidden.get("test_outputs.py", "").splitlines() if ln.strip().startswith("assert")]
    needles += [c for _, c in solve_steps(task) if len(c) >= 8]
    for root, _, files in os.walk(task.env_dir):
        for n in sorted(files):
            p = os.path.join(root, n)
            rel = os.path.relpath(p, task.env_dir)
            with open(p, "rb") as f:
                text = f.read().decode(errors="replace")
            if n in hidden:
                return f"test_leakage: environment/{rel} is named like the task's {n}"
            if n == "Dockerfile" and re.search(r"^\s*(COPY|ADD)\b.*\b(tests|solution)\b", text, re.M):
                return f"test_leakage: environment/{rel} copies the tests or the solution into the image"
            hit = next((x for x in needles if x in text), None)
            if hit:
                return f"test_leakage: environment/{rel} holds `{hit[:60]}` of the tests or the solution"
    instr = " ".join(_words(task.instruction))
    outputs = {r: c for r, (is_dir, _, c) in final.items()  # files whose content the solution wrote
               if not is_dir and c and (r not in initial or initial[r][2] != c)}
    for rel, content in sorted(outputs.items()):
        words = " ".join(_words(content.decode(errors="replace")))
        if words and f" {words} " in f" {instr} ":
            return f"test_leakage: instruction.md states the content of {rel}, which the solution should compute"
        for src, (is_dir, _, c0) in sorted(initial.items()):
            if not is_dir and c0 == content and src != rel and not _reads(solve, src):
                return f"test_leakage: the expected {rel} is already in /app as {src}, which the solution never reads"
    return None


def _reads(solve, src):
    """solve.sh reads /app's src: it names src or its file name, or a command substitution searches a directory
    holding it (`mv d/$(ls -S d | head -1) out`: the find family's expert picks the file by searching)."""
    if src in solve or os.path.basename(src) in solve:
        return True
    parts = src.split("/")[:-1]
    dirs = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(re.search(rf"(?<![\w./-]){re.escape(d)}(?![\w.-])", sub)
               for sub in re.findall(r"\$\(([^)]*)\)", solve) for d in dirs)


def _shortcuts(task, initial):
    """{name: solve.sh text} of the generic trivial solutions."""
    made = []
    for w in task.instruction.split():
        p = w.strip(".,;:'\"`()")
        if (p and not p.startswith("/") and re.fullmatch(r"[\w][\w.-]*(/[\w.-]+)*", p)
                and re.search(r"[\d._/]", p) and p not in initial):
            q = shlex.quote(p)
            made.append(f"mkdir -p $(dirname {q}) && : > {q}" if re.search(r"\w\.\w", p) else f"mkdir -p {q}")
    cuts = {"true": "#!/bin/bash\ntrue\n"}
    if made:  # else the same as `true`
        cuts["empty_paths"] = "#!/bin/bash\ncd /app\n" + "".join(m + "\n" for m in made)
    return cuts


def _run(task_dir, solve, work_root, name):
    """run_trial's oracle on a copy of the task with solution/solve.sh replaced by `solve` (None: unchanged)."""
    if solve is None:
        return rollout.run_trial(task_dir, "oracle", work_root=work_root)
    copy = tempfile.mkdtemp(prefix=f"{name}-", dir=work_root)
    shutil.copytree(task_dir, copy, dirs_exist_ok=True)
    with open(os.path.join(copy, "solution", "solve.sh"), "w") as f:
        f.write(solve)
    try:
        return rollout.run_trial(copy, "oracle", work_root=work_root)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _full(res):
    return res.get("reward_source") == "ctrf" and res["total"] > 0 and res["passed"] == res["total"]


# --- the audit ----------------------------------------------------------------------------------------------
def score_dims(dims):
    """Quality in [0, 1]: the paper's weighted sum of the eight dimensions (each in [0, 1])."""
    return round(sum(WEIGHTS[k] * dims[k] for k in WEIGHTS), 4)


def verdict(reason, quality):
    if reason is not None or quality < BORDERLINE:
        return "rejected"
    return "accepted" if quality >= ACCEPT else "borderline"


def audit(task_dir, work_root=None, expert_resolved=None, reference=None):
    """The four hard rejects and the eight dimensions of one task that data.validate passed.

    work_root: trial dirs go there (None: a temp dir, deleted). expert_resolved: whether the scripted expert
    resolved in data.validate (None: not checked). reference: the oracle's run_trial result kept under work_root
    (data.validate's; None: run here). Returns dict(reason (the first of reasons), reasons (every
    hard reject that fired, in REASONS order), verdict, quality, dims, seconds)."""
    t0 = time.time()
    own = work_root is None
    work_root = tempfile.mkdtemp(prefix="rst-") if own else work_root
    os.makedirs(work_root, exist_ok=True)
    try:
        task = task_io.load_task(task_dir)
        hidden, share = hidden_requirement(task)
        initial = tree_state(os.path.join(task.env_dir, "app"))
        ref = reference if reference and "trial_dir" in reference else _run(task_dir, None, work_root, "reference")
        final = tree_state(os.path.join(ref["trial_dir"], "app")) if "trial_dir" in ref else {}
        leak = test_leakage(task, initial, final)
        cuts = {n: _run(task_dir, s, work_root, n) for n, s in _shortcuts(task, initial).items()}
        passed_cut = sorted(n for n, r in cuts.items() if _full(r))
        shortcut = (f"solution_shortcut: the trivial solution `{passed_cut[0]}` passes every test" if passed_cut
                    else None)
        with open(os.path.join(task.solution_dir, "solve.sh")) as f:
            lines = f.read().splitlines()
        steps, weak = solve_steps(task), []
        for i, cmd in steps:
            res = _run(task_dir, "\n".join(lines[:i] + lines[i + 1:]) + "\n", work_root, f"mutant{i}")
            if _full(res) and tree_state(os.path.join(res["trial_dir"], "app")) != final:
                weak.append(cmd)
        weak_why = f"weak_verifier: solve.sh without `{weak[0]}` still passes every test" if weak else None
        reasons = [r for r in (hidden, leak, shortcut, weak_why) if r]
        total = max(1, ref["total"])
        created = {r.split("/")[0] for r in set(initial) ^ set(final)} | {
            r.split("/")[0] for r in set(initial) & set(final) if initial[r] != final[r]}
        instr_words = set(_words(task.instruction)) | {w.strip(".,;:'\"`()") for w in task.instruction.split()}
        dims = dict(
            instruction_verifier_alignment=share,  # share of the tests' words the agent can see
            verifier_fairness=1.0 if _full(ref) and expert_resolved is not False else 0.0,  # shipped solutions pass
            verifier_strength=1.0 - max([r["passed"] / total for r in cuts.values()] + [0.0]),  # best shortcut
            solution_correctness=ref["passed"] / total,  # the reference solution's share of the tests
            solution_necessity=1.0 - len(weak) / max(1, len(steps)),  # steps some test needs
            instruction_clarity=sum(c in instr_words for c in created) / max(1, len(created)),  # outputs named
            instruction_no_leakage=0.0 if leak else 1.0,
            task_value=0.5 * min(1.0, total / 8) + 0.5 * min(1.0, len(steps) / 4))  # tests and steps: size of work
        dims = {k: round(v, 4) for k, v in dims.items()}
        q = score_dims(dims)
        reason = reasons[0] if reasons else None
        return dict(reason=reason, reasons=reasons, verdict=verdict(reason, q), quality=q, dims=dims,
                    seconds=round(time.time() - t0, 2))
    finally:
        if own:
            shutil.rmtree(work_root, ignore_errors=True)


# --- the optional LLM judge: the paper's semantic audit, through any OpenAI-compatible endpoint ------------------
JUDGE_ROUNDS = 15  # paper: a five-stage, 15-round semantic audit (here: 15 independent judge replies per task)
JUDGE_RUBRIC = """You audit a terminal task for reinforcement learning. The agent sees only the instruction and /app;
the tests run after the agent stops. Reply with exactly one JSON object:
{"hidden_requirement": bool, "test_leakage": bool, "solution_shortcut": bool, "weak_verifier": bool,
 "scores": {DIMS}, "repaired_instruction": null or a clearer instruction}
Hard rejects (true rejects the task): hidden_requirement = a test checks something the instruction never asks
for; test_leakage = expected values are visible to the agent before verification; solution_shortcut = a trivial
command passes the tests; weak_verifier = a wrong or partial solution passes the tests.
Scores in [0, 1], weights: WEIGHTS."""


def judge_prompt(task_dir) -> list:
    """The judge's messages: the rubric (the paper's dimensions and weights, its four hard rejects), then the task:
    instruction, the initial /app (paths and the start of each text file), tests, reference solution."""
    task = task_io.load_task(task_dir)
    dims = ", ".join(f'"{k}": number' for k in WEIGHTS)
    rubric = JUDGE_RUBRIC.replace("DIMS", dims).replace(
        "WEIGHTS", ", ".join(f"{k} {round(100 * v)}%" for k, v in WEIGHTS.items()))
    app = os.path.join(task.env_dir, "app")
    files = []
    for root, _, names in os.walk(app):
        for n in sorted(names):
            path = os.path.join(root, n)
            files.append(f"--- /app/{os.path.relpath(path, app)}\n{_content(path)[:300]}")
    tests = "\n".join(open(os.path.join(task.tests_dir, n)).read() for n in sorted(os.listdir(task.tests_dir))
                      if n.endswith((".py", ".sh")))
    with open(os.path.join(task.solution_dir, "solve.sh")) as f:
        solve = f.read()
    body = (f"Instruction:\n{task.instruction}\n\nInitial /app:\n" + "\n".join(files) +
            f"\n\nTests:\n{tests}\n\nReference solution (solve.sh):\n{solve}")
    return [{"role": "system", "content": rubric}, {"role": "user", "content": body}]


def parse_judgement(text: str):
    """A judge reply -> (dict with the four rejects, scores, repaired_instruction) or (None, why)."""
    start, end = text.find("{"), text.rfind("}")
    try:
        obj = json.loads(text[start:end + 1]) if 0 <= start < end else None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e})"
    if not isinstance(obj, dict):
        return None, "no JSON object"
    bad = [r for r in REASONS if not isinstance(obj.get(r), bool)]
    if bad:
        return None, f"{bad[0]}: expected true or false"
    sc = obj.get("scores")
    if not isinstance(sc, dict) or any(not isinstance(sc.get(k), (int, float)) or isinstance(sc.get(k), bool)
                                       or not 0 <= sc[k] <= 1 for k in WEIGHTS):
        return None, "scores: expected every dimension as a number in [0, 1]"
    fix = obj.get("repaired_instruction")
    return {"rejects": [r for r in REASONS if obj[r]], "scores": {k: float(sc[k]) for k in WEIGHTS},
            "repaired_instruction": fix if isinstance(fix, str) and fix.strip() else None}, None


def judge(task_dir, url: str, rounds: int = JUDGE_ROUNDS, model: str = "t1", timeout: float = 600.0) -> dict:
    """The semantic audit of one task by an LLM at `url` (OpenAI /v1/chat/completions; the project's gateway too):
    `rounds` independent replies; a hard reject flagged by a majority of the parsable replies rejects, quality =
    the paper's weighted sum of the mean scores. No parsable reply is a loud verdict "judge_failed", never a pass.
    A suggested instruction repair is counted, not applied (the task's verifier was audited on its own text)."""
    if rounds < 1:
        raise ValueError(f"judge rounds: must be >= 1, got {rounds}")
    msgs, got, failures = judge_prompt(task_dir), [], []
    for _ in range(rounds):
        try:
            reply = chat_completion(url, msgs, timeout=timeout, model=model, temperature=0.7)
            j, why = parse_judgement(reply["choices"][0]["message"]["content"] or "")
        except (RuntimeError, OSError, KeyError, IndexError, TypeError) as e:
            j, why = None, f"request failed: {e}"
        if j is None:
            failures.append(why)
        else:
            got.append(j)
    if not got:
        return {"verdict": "judge_failed", "reason": f"judge_failed: no parsable reply in {rounds} ({failures[0]})",
                "quality": None, "scores": None, "rounds": rounds, "unparsable": len(failures), "repaired": False}
    votes = collections.Counter(r for j in got for r in j["rejects"])
    rejects = [r for r in REASONS if votes[r] * 2 > len(got)]
    scores = {k: sum(j["scores"][k] for j in got) / len(got) for k in WEIGHTS}
    q = score_dims(scores)
    why = f"{rejects[0]}: flagged by the judge in {votes[rejects[0]]} of {len(got)} replies" if rejects else None
    repaired = sum(j["repaired_instruction"] is not None for j in got) * 2 > len(got)
    return {"verdict": verdict(why, q), "reason": why, "quality": q, "scores": scores, "rounds": rounds,
            "unparsable": len(failures), "repaired": repaired}


def audit_stats(rows):
    """The paper's audit statistics over audited drafts: accepted / borderline / rejected, rejects per reason
    and per family, instructions repaired (the judge's majority suggested a repair; none without a judge: rejected
    slots are redrawn), seconds per audit."""
    by = collections.Counter(r["verdict"] for r in rows)
    reasons = collections.Counter(r["reason"].split(":")[0] for r in rows if r["verdict"] == "rejected")
    fams = collections.defaultdict(collections.Counter)
    for r in rows:
        fams[r["family"]][r["reason"].split(":")[0] if r["verdict"] == "rejected" else r["verdict"]] += 1
    return dict(audited=len(rows), accepted=by["accepted"], borderline=by["borderline"], rejected=by["rejected"],
                rejected_by_reason=dict(sorted(reasons.items())),
                instructions_repaired=sum(bool(r.get("repaired")) for r in rows),  # judged repairable (not applied)
                per_family={f: dict(sorted(c.items())) for f, c in sorted(fams.items())},
                seconds_per_task=round(sum(r["seconds"] for r in rows) / max(1, len(rows)), 2),
                audit_seconds_per_task=round(sum(r.get("audit_s", 0.0) for r in rows) / max(1, len(rows)), 2))


def format_stats(st):
    """Lines like the paper's audit statistics, from audit_stats()."""
    why = ", ".join(f"{k} {v}" for k, v in st["rejected_by_reason"].items()) or "none"
    return ([f"[audit] {st['audited']} audited: accepted {st['accepted']} / borderline {st['borderline']} / "
             f"rejected {st['rejected']} ({why}); instructions repaired {st['instructions_repaired']}; "
             f"{st['seconds_per_task']} s per task in sandboxes, {st['audit_seconds_per_task']} s of it the audit"]
            + [f"[audit]   {fam:8s} " + ", ".join(f"{k} {v}" for k, v in c.items())
               for fam, c in st["per_family"].items()])
