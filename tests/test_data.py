"""Tests for data.py: Harbor task synthesis, audit in real sandboxes, pools, TB2 loading."""
import concurrent.futures as cf
import json
import os
import random
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import data  # noqa: E402
from tasks import families  # noqa: E402
from tasks import rst  # noqa: E402
from sandbox import task_io  # noqa: E402

S = data.SCALE


@pytest.fixture(scope="module", autouse=True)
def no_task_cache():
    """The generator's own tests generate (the suite's T1_TASK_CACHE would copy a pool of the same arguments, and the
    determinism tests would compare a pool with its copy); the cache's tests: tests/test_pool_cache.py."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("T1_TASK_CACHE", raising=False)
        yield


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """12 train + 6 held-out tasks (two of each family in train), not sandbox-validated."""
    out = tmp_path_factory.mktemp("tasks")
    train, heldout = data.generate_tasks(str(out), 12, 6, seed=3, validate_tasks=False)
    return out, train, heldout


def _tree(root):
    files = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                files[os.path.relpath(p, root)] = (f.read(), os.stat(p).st_mode)
    return files


def test_every_family_generates_valid_harbor_dirs(pool):
    _, train, heldout = pool
    seen = {}
    for d in train + heldout:
        t = task_io.load_task(d)
        meta = t.config["metadata"]
        seen[meta["family"]] = seen.get(meta["family"], 0) + 1
        assert meta["split"] == ("train" if d in train else "heldout")
        assert 0 < meta["quality"] <= 1 and meta["difficulty"] in ("easy", "medium")
        assert t.config["verifier"]["timeout_sec"] > 0 and t.config["agent"]["timeout_sec"] > 0
        for rel in ("environment/Dockerfile", "environment/app", "tests/test.sh", "tests/test_outputs.py",
                    "solution/solve.sh", "solution/terminus2.json"):
            assert os.path.exists(os.path.join(d, rel)), rel
        assert "COPY app/ /app/" in open(os.path.join(d, "environment/Dockerfile")).read()
        assert "pytest --ctrf /logs/verifier/ctrf.json" in open(os.path.join(t.tests_dir, "test.sh")).read()
        n_tests = open(os.path.join(t.tests_dir, "test_outputs.py")).read().count("\ndef test_")
        assert 3 <= n_tests <= 6 and n_tests == meta["n_assertions"]
        replies = json.load(open(os.path.join(t.solution_dir, "terminus2.json")))
        assert [r["task_complete"] for r in replies[-2:]] == [True, True]
        assert all(not r["task_complete"] and r["commands"] for r in replies[:-2]) and 1 <= len(replies) - 2 <= 2
        for r in replies:
            assert set(r) == {"analysis", "plan", "commands", "task_complete"}
            assert all(c["keystrokes"].endswith("\n") and c["duration"] > 0 for c in r["commands"])
        app_files = [f for _, _, fs in os.walk(os.path.join(t.env_dir, "app")) for f in fs]
        assert not {"test_outputs.py", "test.sh", "solve.sh"} & set(app_files)  # no leakage into /app
    assert set(seen) == set(families.FAMILIES) and len(families.FAMILIES) >= 6


def _one_per_family(dirs):
    seen = {}
    for d in dirs:
        seen.setdefault(task_io.load_task(d).config["metadata"]["family"], d)
    return [seen[f] for f in families.FAMILIES]


def test_oracle_resolves_and_nop_scores_zero_for_every_family(pool, tmp_path):
    rollout = pytest.importorskip("rollout")
    tasks = _one_per_family(pool[1])
    jobs = [(d, agent) for d in tasks for agent in ("oracle", "nop")]
    with cf.ThreadPoolExecutor(2) as ex:
        res = list(ex.map(lambda j: rollout.run_trial(j[0], j[1], work_root=str(tmp_path)), jobs))
    for (d, agent), r in zip(jobs, res):
        n = task_io.load_task(d).config["metadata"]["n_assertions"]
        assert r["total"] == n and r["reward_source"] == "ctrf", (d, agent, r)
        if agent == "oracle":  # every assertion passes; r = P / S
            assert r["resolved"] and r["passed"] == n and r["reward"] == pytest.approx(n / S), (d, r)
        else:  # untouched environment: no assertion passes
            assert not r["resolved"] and r["passed"] == 0 and r["reward"] == 0.0, (d, r)


def test_scripted_expert_trajectory_resolves_for_every_family(pool, tmp_path):
    rollout = pytest.importorskip("rollout")
    model = pytest.importorskip("model")
    tasks = _one_per_family(pool[1])
    tok = model.train_tokenizer(data.corpus(pool[1]))
    with cf.ThreadPoolExecutor(2) as ex:
        res = list(ex.map(lambda d: rollout.run_trial(d, "scripted", tokenizer=tok, work_root=str(tmp_path)), tasks))
    for d, r in zip(tasks, res):
        assert r["resolved"] and r["exit_reason"] == "task_complete", (d, r)


def _find_kinds():
    """One find spec of each kind (grep / name / largest), told apart by their instructions."""
    kinds = {}
    for seed in range(200):
        spec = families.fam_find(random.Random(seed))
        kind = ("grep" if spec["instruction"].startswith("One file") else
                "largest" if spec["instruction"].startswith("Move the largest") else "name")
        kinds.setdefault(kind, spec)
    assert set(kinds) == {"grep", "name", "largest"}
    return kinds


def test_find_expert_copies_names_from_the_instruction_only():
    """families departure 3: the miniature cannot copy a path off the terminal, so the find expert's one command
    names only what the instruction names (the found path travels by command substitution)."""
    for kind, spec in _find_kinds().items():
        assert len(spec["turns"]) == 1, kind
        cmds = " ".join(c for t in spec["turns"] for c in t["cmds"])
        names = re.findall(r"[A-Za-z]+\d+(?:_data)?(?:\.\w+)?", cmds)
        assert names and all(n in spec["instruction"] for n in names), (kind, cmds, spec["instruction"])
        assert "$(" in cmds, kind


def _perms_kinds():
    """One perms spec of each kind (a script to write / modes to set), and the modes kind with one RST step."""
    kinds = {}
    for seed in range(50):
        spec = families.fam_perms(random.Random(seed))
        kinds.setdefault("modes" if " mode " in spec["instruction"] else "script", spec)
    kinds["modes_rst"] = families.rst_extend(kinds["modes"], "perms", random.Random(1), 1)
    assert set(kinds) == {"script", "modes", "modes_rst"} and " Then " in kinds["modes_rst"]["instruction"]
    return kinds


def test_perms_modes_kind_passes_the_static_audit_and_shows_no_clock():
    """The modes kind changes app files in place (spec "edits"): the static audit's "output already in /app" rule
    skips those (it rejected every modes draw, so every perms task was the script kind), and its expert shows the
    modes with stat, not `ls -l`, whose times and trial uids would differ between two runs of one seed."""
    for seed in range(100):
        spec = families.fam_perms(random.Random(seed))
        assert data.static_audit(spec) is None, (seed, spec["instruction"])
        assert not any(c.startswith("ls -l") for t in spec["turns"] for c in t["cmds"])
    drawn = [data._draw("train", slot, 0, set())[1]["instruction"] for slot in range(2, 600, 6)]  # perms slots
    assert 30 <= sum(" mode " in i for i in drawn) <= 90  # the modes kind is 60% of the draws again


@pytest.mark.parametrize("family", ["find", "csvjson", "perms"])
def test_expert_resolves_every_kind_in_a_sandbox(tmp_path, family):
    """Each kind's expert (the one-command experts of families departures 3 and 4; both perms kinds) passes
    data.validate in real sandboxes: the oracle resolves, nop fails, and the scripted Terminus-2 trajectory
    resolves; and rst.audit with no reason."""
    pytest.importorskip("rollout")
    model = pytest.importorskip("model")
    specs = {"find": _find_kinds, "csvjson": _csv_kinds, "perms": _perms_kinds}[family]()
    dirs = {k: data.write_task(str(tmp_path / k), spec, family, "train", "0") for k, spec in specs.items()}
    tok = model.train_tokenizer(data.corpus(list(dirs.values())))
    with cf.ThreadPoolExecutor(2) as ex:
        res = dict(zip(dirs, ex.map(lambda d: data.validate(d, tok, str(tmp_path / "w")), dirs.values())))
        assert res == {k: None for k in dirs}, res
        audits = dict(zip(dirs, ex.map(lambda d: rst.audit(d, str(tmp_path / "a")), dirs.values())))
    # the found file is the expected output: the audit sees the search in $(...) as reading it, not as a leak
    assert {k: a["reasons"] for k, a in audits.items()} == {k: [] for k in dirs}, audits


def _csv_kinds():
    """One csvjson spec of each CSV kind (filter / sum), told apart by their instructions."""
    kinds = {}
    for seed in range(200):
        spec = families.fam_csvjson(random.Random(seed))
        if ".csv" in spec["instruction"]:
            kinds.setdefault("sum" if spec["instruction"].startswith("Write the sum") else "filter", spec)
    assert set(kinds) == {"filter", "sum"}
    return kinds


def test_csv_expert_finds_the_column_by_the_name_the_instruction_gives():
    """families departure 4: one awk command names the column as the instruction does (no column number read off
    the terminal), and every file name in it is the instruction's."""
    for kind, spec in _csv_kinds().items():
        assert len(spec["turns"]) == 1, kind
        cmd = spec["turns"][0]["cmds"][0]
        column = re.search(r"-v c=(\w+)", cmd).group(1)
        assert f"the {column} column" in spec["instruction"] or f"whose {column} is" in spec["instruction"], kind
        names = re.findall(r"[a-z]+\d+\.\w+", cmd)
        assert len(names) == 2 and all(n in spec["instruction"] for n in names), (kind, cmd, spec["instruction"])
        assert not re.search(r"\$[0-9]*[02-9]", cmd), (kind, cmd)  # no column number but the name's ($1)


def test_leakage_reads_through_a_search_of_the_files_directory_only():
    assert rst._reads("mv d/$(ls -S d | head -1) out\n", "d/x.txt")
    assert rst._reads("cp $(grep -rl W d) out\n", "d/s/x.txt")
    assert not rst._reads("cp $(grep -rl W e) out\n", "d/s/x.txt")  # another directory
    assert not rst._reads("cp $(grep -rl W dd) out\n", "d/x.txt")  # d is only a prefix of dd
    assert not rst._reads("mv d/a.txt out\n", "d/x.txt")  # d named outside a substitution
    assert not rst._reads("cat $(echo out)\n", ".answer")  # a file at /app's top has no directory to search


def test_generate_with_audit_keeps_only_resolving_tasks(tmp_path):
    pytest.importorskip("rollout")
    train, heldout = data.generate_tasks(str(tmp_path), 6, 0, seed=11, scripted=False)
    summary = json.load(open(tmp_path / "summary.json"))
    assert len(train) == 6 and heldout == [] and summary["validated"] is True
    assert summary["dropped_total"] == 0 and summary["unrecovered"] == 0
    assert not (tmp_path / ".sandboxes").exists()
    st = summary["audit"]  # the RST audit ran on every task; its quality is what orders the pool
    assert st["audited"] == 6 and st["accepted"] + st["borderline"] == 6 and st["rejected"] == 0
    for d in train:
        meta = task_io.load_task(d).config["metadata"]
        assert meta["audit"] in ("accepted", "borderline") and 0.7 <= meta["quality"] <= 1


def test_every_family_resolves_with_a_fault_turn(pool, tmp_path):
    """--sft-faults: the scripted expert recovers from each fault kind on every family, through the sandbox (the
    SFT data keeps only resolved trials: a fault that broke a task would silently thin the SFT set)."""
    rollout = pytest.importorskip("rollout")
    model = pytest.importorskip("model")
    tasks = _one_per_family(pool[1])
    tok = model.train_tokenizer(data.corpus(tasks))
    runs = [(d, seed) for d in tasks for seed in (1, 2)]
    with cf.ThreadPoolExecutor(2) as ex:
        res = list(ex.map(lambda a: rollout.run_trial(a[0], "scripted", tokenizer=tok, script_faults=1.0, seed=a[1]),
                          runs))
    kinds = set()
    for (d, seed), r in zip(runs, res):
        assert r["resolved"] and r["exit_reason"] == "task_complete", (d, seed, r)
        assert sum(bool(x.get("unscored")) for x in r["records"]) == 1
        kinds.add(r["invalid_replies"])
    assert kinds == {0, 1}  # both a refused reply and a misspelled command among them


def test_terse_expert_text_keeps_the_commands_and_resolves_for_every_family(tmp_path):
    """--expert-text terse: the same tasks and commands, fixed free text; the scripted expert still solves each
    family (through the real sandbox), and the held-out split alone is audited with validate_train=False."""
    rollout = pytest.importorskip("rollout")
    model = pytest.importorskip("model")
    full, _ = data.generate_tasks(str(tmp_path / "full"), 12, 0, seed=8, validate_tasks=False)
    terse, held = data.generate_tasks(str(tmp_path / "terse"), 12, 1, seed=8, validate_train=False,
                                      expert_text="terse", scripted=False)
    summary = json.load(open(tmp_path / "terse" / "summary.json"))
    assert summary["validated"] is True and summary["train_validated"] is False
    assert summary["audit"]["audited"] == 1 and len(terse) == 12 and len(held) == 1  # held-out only
    words = set()
    for a, b in zip(full, terse):
        ra, rb = (json.load(open(os.path.join(d, "solution", "terminus2.json"))) for d in (a, b))
        assert [r["commands"] for r in ra] == [r["commands"] for r in rb]  # same tasks, same keystrokes
        assert _tree(os.path.join(a, "tests")) == _tree(os.path.join(b, "tests"))
        words |= {(r["analysis"], r["plan"]) for r in rb}
    assert len(words) == 3  # work turns, done, confirmation: the same three on every task
    tasks = _one_per_family(terse)
    tok = model.train_tokenizer(data.corpus(terse))
    with cf.ThreadPoolExecutor(2) as ex:
        res = list(ex.map(lambda d: rollout.run_trial(d, "scripted", tokenizer=tok, work_root=str(tmp_path)), tasks))
    for d, r in zip(tasks, res):
        assert r["resolved"] and r["exit_reason"] == "task_complete", (d, r)
    with pytest.raises(ValueError, match="text must be one of"):
        families.expert_replies(families.fam_files(random.Random(0)), "short")


def test_restate_expert_text_opens_on_the_instruction_verbatim():
    """--expert-text restate: the full text, the first analysis opening on the task's instruction word for word
    (RST's extended instruction included); the commands and the other turns' text unchanged."""
    for fam in (families.fam_files, families.fam_csvjson):
        spec = fam(random.Random(3))
        spec = families.rst_extend(spec, fam.__name__[4:], random.Random(4), 1) if fam is families.fam_csvjson else spec
        full, rest = families.expert_replies(spec, "full"), families.expert_replies(spec, "restate")
        assert rest[0]["analysis"] == f"The task: {spec['instruction']} {full[0]['analysis']}"
        assert [r["commands"] for r in rest] == [r["commands"] for r in full] and rest[1:] == full[1:]


def test_train_and_heldout_are_disjoint(tmp_path):
    train, heldout = data.generate_tasks(str(tmp_path), 60, 30, seed=0, validate_tasks=False)
    ins_train = {task_io.load_task(d).instruction for d in train}
    ins_held = {task_io.load_task(d).instruction for d in heldout}
    assert len(ins_train) == 60 and len(ins_held) == 30 and not ins_train & ins_held
    assert all("/train/" in d for d in train) and all("/heldout/" in d for d in heldout)


def test_a_validation_split_avoids_the_pools_instructions(tmp_path):
    """generate_tasks(heldout_split="val", avoid=...): the second split under val/, its tasks named val-*, drawn
    apart from the held-out ones (the same seed gives other tasks), none with an instruction in avoid."""
    train, heldout = data.generate_tasks(str(tmp_path / "pools"), 12, 12, seed=4, validate_tasks=False)
    taken = {task_io.load_task(d).instruction for d in train + heldout}
    _, val = data.generate_tasks(str(tmp_path / "val"), 0, 12, seed=4, validate_tasks=False, heldout_split="val",
                                 avoid=taken)
    ins = {task_io.load_task(d).instruction for d in val}
    assert len(ins) == 12 and not ins & taken
    assert all("/val/val-" in d for d in val) and sorted(os.listdir(tmp_path / "val")) == ["summary.json", "val"]
    # a task drawn for the validation split that an avoided instruction would have been is redrawn
    first = task_io.load_task(val[0]).instruction
    _, again = data.generate_tasks(str(tmp_path / "again"), 0, 1, seed=4, validate_tasks=False, heldout_split="val",
                                   avoid=taken | {first})
    assert task_io.load_task(again[0]).instruction not in taken | {first}


def test_generation_is_deterministic_given_seed(tmp_path):
    a, b, c = (tmp_path / x for x in "abc")
    data.generate_tasks(str(a), 6, 3, seed=5, validate_tasks=False)
    data.generate_tasks(str(b), 6, 3, seed=5, validate_tasks=False)
    data.generate_tasks(str(c), 6, 3, seed=6, validate_tasks=False)
    ta, tb, tc = _tree(a / "train"), _tree(b / "train"), _tree(c / "train")
    assert ta == tb and _tree(a / "heldout") == _tree(b / "heldout")
    assert sorted(os.listdir(a / "train")) == sorted(os.listdir(c / "train"))  # same families per slot
    assert ta != tc  # different parameters


def test_generation_is_byte_identical_across_processes(tmp_path):
    """The same seed in two processes with different hash seeds writes the same bytes (no set order leaks into a
    test file: seed 9's held-out has a uniq text task and a csvjson name set)."""
    code = "import sys, data; data.generate_tasks(sys.argv[1], 18, 12, seed=9, validate_tasks=False, rst_rounds=1)"
    for name, hash_seed in (("a", "1"), ("b", "2")):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], cwd=HERE, check=True,
                       env=dict(os.environ, PYTHONHASHSEED=hash_seed))
    for split in ("train", "heldout"):
        assert _tree(tmp_path / "a" / split) == _tree(tmp_path / "b" / split)


TB2_TOML = '''version = "1.0"

[metadata]
author_name = "Jane Doe"
author_email = "jane@example.com"
difficulty = "medium"
category = "system-administration"
tags = ["bash", "logs"]
expert_time_estimate_min = 20.0
junior_time_estimate_min = 60.0

[verifier]
timeout_sec = 900.0

[agent]
timeout_sec = 1800.0

[environment]
build_timeout_sec = 600.0
docker_image = "alexgshaw/rotate-logs:20251031"
cpus = 1
memory = "2G"
storage = "10G"
'''


def _tb2_task(root):
    files = {"task.toml": TB2_TOML,
             "instruction.md": "Rotate the logs in /var/log/app and keep the last 3 files.\n",
             "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\nRUN mkdir -p /var/log/app\n",
             "tests/test.sh": "#!/bin/bash\ncurl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n"
                              "uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf "
                              "/logs/verifier/ctrf.json /tests/test_outputs.py -rA\n",
             "tests/test_outputs.py": "def test_rotated():\n    assert True\n",
             "solution/solve.sh": "#!/bin/bash\nls /var/log/app\n"}
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_terminal_bench2_style_task_loads_unchanged(tmp_path):
    d = _tb2_task(tmp_path / "rotate-logs")
    before = _tree(d)
    t = task_io.load_task(str(d))
    assert t.name == "rotate-logs" and t.instruction.startswith("Rotate the logs")
    assert t.config["metadata"]["category"] == "system-administration"
    assert t.config["environment"]["memory"] == "2G" and t.config["verifier"]["timeout_sec"] == 900.0
    assert t.tests_dir == str(d / "tests") and t.solution_dir == str(d / "solution")
    assert t.env_dir == str(d / "environment")
    assert _tree(d) == before  # loading never touches the dir
    assert data.ordered_pool([str(d)]) == [str(d)]  # no quality field: still usable in a pool


@pytest.mark.parametrize("breakage, needle", [
    (lambda d: (d / "instruction.md").unlink(), "instruction.md"),
    (lambda d: (d / "task.toml").write_text("[metadata\nx = 1"), "task.toml"),
    (lambda d: (d / "task.toml").unlink(), "task.toml"),
    (lambda d: (d / "tests" / "test.sh").unlink(), "tests/test.sh"),
    (lambda d: (d / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n'), "timeout_sec"),
])
def test_malformed_task_dir_raises_naming_the_file(tmp_path, breakage, needle):
    d = _tb2_task(tmp_path / "t")
    breakage(d)
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        task_io.load_task(str(d))
    with pytest.raises(ValueError, match="does not exist"):
        task_io.load_task(str(tmp_path / "nope"))


def test_static_audit_rejects_hidden_requirement_leakage_and_weak_verifier():
    import random
    spec = families.fam_text(random.Random(0))
    assert data.static_audit(spec) is None
    out = spec["outputs"][0]
    assert "hidden requirement" in data.static_audit(dict(spec, instruction="Do the thing."))
    assert "shortcut" in data.static_audit(dict(spec, files={**spec["files"], out: "x"}))
    assert "leakage" in data.static_audit(dict(spec, files={**spec["files"], "test_outputs.py": "x"}))
    assert "weak verifier" in data.static_audit(dict(spec, tests=spec["tests"][:2]))


def test_ordered_pool_by_quality_and_reshuffled_per_epoch(pool):
    _, train, _ = pool
    ordered = data.ordered_pool(train)
    q = [task_io.load_task(d).config["metadata"]["quality"] for d in ordered]
    assert sorted(ordered) == sorted(train) and q == sorted(q, reverse=True)
    assert data.ordered_pool(train, n=4) == ordered[:4]
    e0, e0b, e1 = data.epoch_order(ordered, 0, 1), data.epoch_order(ordered, 0, 1), data.epoch_order(ordered, 1, 1)
    assert e0 == e0b and e0 != e1 and sorted(e0) == sorted(e1) == sorted(ordered)


def test_corpus_holds_instructions_replies_and_terminal_text(pool):
    _, train, _ = pool
    texts = data.corpus(train)
    t = task_io.load_task(train[0])
    assert t.instruction in texts
    reply = json.load(open(os.path.join(t.solution_dir, "terminus2.json")))[0]
    assert json.dumps(reply) in texts
    assert any(x.startswith("root@sandbox:/app# ") for x in texts)


def test_cli_generate_prints_summary_line(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(HERE, "data.py"), "generate", "--out", str(tmp_path / "t"),
                          "--n-train", "6", "--n-heldout", "2", "--seed", "1", "--no-validate"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()
    s = json.loads(out[-1])
    assert s["train"] == 6 and s["heldout"] == 2 and len(s["families"]) == 6


def test_audit_rejects_broken_oracle_and_weak_verifier(pool, tmp_path):
    pytest.importorskip("rollout")
    import shutil
    src = _one_per_family(pool[1])[0]
    broken, weak = tmp_path / "broken", tmp_path / "weak"
    shutil.copytree(src, broken)
    shutil.copytree(src, weak)
    (broken / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    n = task_io.load_task(src).n_assertions  # as many trivial tests as the task records: the count check passes
    (weak / "tests" / "test_outputs.py").write_text("".join(f"def test_{i}():\n    assert True\n" for i in range(n)))
    assert data.validate(src, work_root=str(tmp_path)) is None
    assert data.validate(str(broken), work_root=str(tmp_path)).startswith("oracle not resolved: 0/")
    assert data.validate(str(weak), work_root=str(tmp_path)) == "weak verifier: nop scores full"


# --- task.toml numbers (every timeout is finite) and n_assertions (rewards are bounded) --------
def _with_toml(root, text):
    d = _tb2_task(root)
    (d / "task.toml").write_text(text)
    return d


@pytest.mark.parametrize("table, key", [("verifier", "timeout_sec"), ("agent", "timeout_sec"),
                                        ("environment", "build_timeout_sec")])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "-1", "0", "0.0", "true", '"10"', "1e9", "[1]"])
def test_task_toml_timeouts_must_be_positive_finite_seconds(tmp_path, table, key, value):
    d = _with_toml(tmp_path / "t", f"[{table}]\n{key} = {value}\n")
    with pytest.raises(ValueError) as e:
        task_io.load_task(str(d))
    msg = str(e.value)
    assert str(d / "task.toml") in msg and f"[{table}] {key}" in msg, msg


def test_task_toml_finite_timeouts_load(tmp_path):
    d = _with_toml(tmp_path / "t", "[verifier]\ntimeout_sec = 900\n[agent]\ntimeout_sec = 1.5\n"
                                   "[environment]\nbuild_timeout_sec = 600.0\n")
    t = task_io.load_task(str(d))
    assert t.config["verifier"]["timeout_sec"] == 900 and t.config["agent"]["timeout_sec"] == 1.5


@pytest.mark.parametrize("text, needle", [
    ("[environment]\ncpus = 0\n", "[environment] cpus"),
    ("[environment]\ncpus = true\n", "[environment] cpus"),
    ("[environment]\nmemory_mb = nan\n", "[environment] memory_mb"),
    ("[environment]\nstorage_mb = -5\n", "[environment] storage_mb"),
    ("[metadata]\nquality = inf\n", "[metadata] quality"),
    ("[metadata]\nquality = \"high\"\n", "[metadata] quality"),
    ("verifier = 5\n", "[verifier] must be a table"),
    ("[metadata]\nn_assertions = 0\n", "[metadata] n_assertions"),
    ("[metadata]\nn_assertions = -3\n", "[metadata] n_assertions"),
    ("[metadata]\nn_assertions = true\n", "[metadata] n_assertions"),
    ("[metadata]\nn_assertions = 4.0\n", "[metadata] n_assertions"),
    ("[metadata]\nn_assertions = \"4\"\n", "[metadata] n_assertions"),
])
def test_task_toml_numeric_fields_refused_by_name(tmp_path, text, needle):
    d = _with_toml(tmp_path / "t", text)
    with pytest.raises(ValueError) as e:
        task_io.load_task(str(d))
    assert str(d / "task.toml") in str(e.value) and needle in str(e.value), str(e.value)


def test_n_assertions_parsed_from_metadata_or_audit_file(tmp_path, pool):
    gen = pool[1][0]
    assert task_io.load_task(gen).n_assertions == task_io.load_task(gen).config["metadata"]["n_assertions"] >= 3
    d = _tb2_task(tmp_path / "tb2")
    assert task_io.load_task(str(d)).n_assertions is None  # a Terminal-Bench task: not audited yet
    (d / task_io.AUDIT_FILE).write_text('{"n_assertions": 7}')
    assert task_io.load_task(str(d)).n_assertions == 7
    (d / "task.toml").write_text(TB2_TOML.replace('[metadata]\n', '[metadata]\nn_assertions = 6\n'))
    with pytest.raises(ValueError, match="n_assertions = 6 but t1_audit.json records 7"):
        task_io.load_task(str(d))
    for bad in ('{"n_assertions": 0}', '{"n_assertions": true}', '{"tests": 7}', "[" * 100000, "x" * 5000):
        (d / task_io.AUDIT_FILE).write_text(bad)
        with pytest.raises(ValueError, match="t1_audit.json"):
            task_io.load_task(str(d))
    (d / task_io.AUDIT_FILE).unlink()
    (tmp_path / "forged.json").write_text('{"n_assertions": 6}')
    (d / task_io.AUDIT_FILE).symlink_to(tmp_path / "forged.json")
    with pytest.raises(ValueError, match="without following a link"):
        task_io.load_task(str(d))


def test_audit_checks_and_records_the_oracle_assertion_count(pool, tmp_path):
    pytest.importorskip("rollout")
    import re
    import shutil
    src = _one_per_family(pool[1])[1]
    n = task_io.load_task(src).n_assertions
    fewer, unrecorded = tmp_path / "fewer", tmp_path / "unrecorded"
    shutil.copytree(src, fewer)
    shutil.copytree(src, unrecorded)
    toml = (fewer / "task.toml").read_text()
    (fewer / "task.toml").write_text(re.sub(r"n_assertions = \d+", f"n_assertions = {n - 1}", toml))
    (unrecorded / "task.toml").write_text(re.sub(r"n_assertions = \d+\n", "", toml))
    assert task_io.load_task(str(unrecorded)).n_assertions is None
    # the oracle's report has n tests, one more than recorded: the audit rejects it (whether the jail's
    # reward.compute already refused the report or the count check here catches it)
    why = data.validate(str(fewer), work_root=str(tmp_path / "w"))
    assert why is not None and why.startswith(("assertion count", "oracle has no usable CTRF")), why
    assert not (fewer / task_io.AUDIT_FILE).exists()
    assert data.validate(str(unrecorded), work_root=str(tmp_path / "w")) is None
    assert json.loads((unrecorded / task_io.AUDIT_FILE).read_text())["n_assertions"] == n
    assert task_io.load_task(str(unrecorded)).n_assertions == n


# --- the mechanical RST audit (tasks/rst.py): each hard reject on a task built to violate it -------------
def _hostile_tasks(root):
    """A good text task and four copies, each breaking one rule of the audit (built from the family specs)."""
    import random
    import rollout
    good = families.fam_text(random.Random(0))
    out = good["outputs"][0]
    hidden = dict(good, tests=good["tests"] + [("report", ["assert os.path.isfile(A + '/zz_report.md')"])],
                  turns=good["turns"] + [families._turn("Write the report.", "touch it", ["touch zz_report.md"])])
    shortcut = dict(good, tests=[(f"exists_{i}", [f"assert os.path.isfile(A + '/{out}')"]) for i in range(3)])
    files = families.fam_files(random.Random(0))  # without its file_deleted test, the `rm` step is never checked
    weak = dict(files, tests=[t for t in files["tests"] if t[0] != "file_deleted"])
    dirs = {name: data.write_task(str(root / name), spec, fam, "train", "0") for name, spec, fam in [
        ("good", good, "text"), ("hidden", hidden, "text"), ("shortcut", shortcut, "text"), ("weak", weak, "files")]}
    ref = rollout.run_trial(dirs["good"], "oracle", work_root=str(root / "w"))  # the expected output, planted in /app
    leak = str(root / "leak")
    import shutil
    shutil.copytree(dirs["good"], leak)
    shutil.copy(os.path.join(ref["trial_dir"], "app", out), os.path.join(leak, "environment", "app", ".answer"))
    dirs["leak"] = leak
    return dirs


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    pytest.importorskip("rollout")
    root = tmp_path_factory.mktemp("rst")
    dirs = _hostile_tasks(root)
    work = str(root / "w")

    with cf.ThreadPoolExecutor(2) as ex:
        return dict(zip(dirs, ex.map(lambda d: rst.audit(d, work), dirs.values())))


def test_audit_accepts_a_good_generated_task(audited):
    a = audited["good"]
    assert a["reason"] is None and a["reasons"] == [] and a["verdict"] in ("accepted", "borderline")
    assert a["dims"]["instruction_verifier_alignment"] == a["dims"]["solution_correctness"] == 1.0
    assert a["dims"]["instruction_no_leakage"] == a["dims"]["solution_necessity"] == 1.0


@pytest.mark.parametrize("name, rule", [("hidden", "hidden_requirement"), ("leak", "test_leakage"),
                                        ("shortcut", "solution_shortcut"), ("weak", "weak_verifier")])
def test_audit_rejects_a_task_violating_one_rule_for_that_reason(audited, name, rule):
    a = audited[name]
    assert a["dims"]["solution_correctness"] == 1.0  # the reference solution still resolves: only the rule rejects
    assert [r.split(":")[0] for r in a["reasons"]] == [rule], a["reasons"]
    assert a["reason"].startswith(rule + ": ") and a["verdict"] == "rejected"


def test_quality_is_the_papers_weighted_sum():
    assert sum(rst.WEIGHTS.values()) == pytest.approx(1.0) and len(rst.WEIGHTS) == 8
    facets = {f: sum(rst.WEIGHTS[k] for k in ks) for f, ks in rst.FACETS.items()}
    assert facets == pytest.approx(dict(verifier=0.45, solution=0.25, instruction=0.20, task_value=0.10))
    assert rst.WEIGHTS["instruction_verifier_alignment"] == 0.20
    assert rst.score_dims(dict.fromkeys(rst.WEIGHTS, 1.0)) == 1.0
    assert rst.verdict(None, rst.ACCEPT) == "accepted" and rst.verdict(None, rst.BORDERLINE) == "borderline"
    assert rst.verdict(None, rst.BORDERLINE - 0.01) == "rejected" and rst.verdict("weak_verifier: x", 1.0) == "rejected"


def test_audit_statistics_are_counted_and_printed_like_the_papers():
    rows = [dict(family="text", verdict="accepted", reason=None, seconds=2.0, audit_s=1.0),
            dict(family="text", verdict="borderline", reason=None, seconds=2.0, audit_s=1.0),
            dict(family="find", verdict="rejected", reason="weak_verifier: solve.sh without `rm x`", seconds=4.0),
            dict(family="find", verdict="rejected", reason="oracle not resolved: 0/3", seconds=0.0)]
    st = rst.audit_stats(rows)
    assert (st["accepted"], st["borderline"], st["rejected"], st["audited"]) == (1, 1, 2, 4)
    assert st["rejected_by_reason"] == {"oracle not resolved": 1, "weak_verifier": 1}
    assert st["per_family"] == {"find": {"oracle not resolved": 1, "weak_verifier": 1},
                                "text": {"accepted": 1, "borderline": 1}}
    assert st["seconds_per_task"] == 2.0 and st["audit_seconds_per_task"] == 0.5
    lines = rst.format_stats(st)
    assert lines[0].startswith("[audit] 4 audited: accepted 1 / borderline 1 / rejected 2 (oracle not resolved 1, "
                               "weak_verifier 1); instructions repaired 0")
    assert len(lines) == 3 and "text" in lines[2] and "borderline 1" in lines[2]


def test_generate_drops_and_redraws_a_draft_the_audit_rejects(tmp_path, monkeypatch):
    pytest.importorskip("rollout")
    calls = []

    def files_first_weak(rng):  # the first draft lacks its file_deleted test: the `rm` step is never checked
        spec = families.fam_files(rng)
        calls.append(spec["instruction"])
        return dict(spec, tests=[t for t in spec["tests"] if t[0] != "file_deleted"]) if len(calls) == 1 else spec
    monkeypatch.setitem(families.FAMILIES, "files", files_first_weak)
    train, _ = data.generate_tasks(str(tmp_path), 1, 0, seed=2, scripted=False)
    summary = json.load(open(tmp_path / "summary.json"))
    assert len(calls) == 2 and len(train) == 1 and task_io.load_task(train[0]).instruction.strip() == calls[1]
    assert summary["dropped"] == {"weak_verifier": 1} and summary["unrecovered"] == 0
    st = summary["audit"]
    assert (st["audited"], st["accepted"] + st["borderline"], st["rejected"]) == (2, 1, 1)
    assert st["rejected_by_reason"] == {"weak_verifier": 1} and st["per_family"]["files"]["weak_verifier"] == 1


def test_overlap_reports_how_new_the_heldout_tasks_are(pool):
    _, train, heldout = pool
    o = data.overlap(train, heldout)
    assert o["instructions_shared"] == 0 and 0 < o["word_seen"] < 1 and o["command_line_seen"] < 0.5
    same = data.overlap(train, train[:3])  # a pool against itself: everything seen
    assert same == {"instructions_shared": 3, "word_seen": 1.0, "command_line_seen": 1.0, "tasks_all_lines_seen": 3,
                    "templates_shared": 1.0, "names_seen": 1.0}


# --- RST: recursive task synthesis -------------------------------------------------------------------------

def test_rst_extend_adds_steps_tests_and_rewrites_the_instruction():
    import random
    seed = families.fam_text(random.Random(1))
    before = json.dumps(seed)
    ext = families.rst_extend(seed, "text", random.Random(2), 2)
    assert json.dumps(seed) == before  # the seed spec is not changed
    assert ext["instruction"].startswith(seed["instruction"]) and ext["instruction"].count(" Then ") == 2
    assert len(ext["turns"]) == len(seed["turns"]) + 2 and len(ext["tests"]) > len(seed["tests"])
    for o in ext["outputs"][len(seed["outputs"]):]:
        assert o in ext["instruction"]  # every new output is asked for
    assert all(n.isidentifier() for n, _ in ext["tests"])
    assert json.dumps(families.rst_extend(seed, "text", random.Random(2), 2)) == json.dumps(ext)  # deterministic
    assert data.static_audit(ext) is None


def test_rst_share_extends_a_share_of_the_slots_and_leaves_the_rest_their_seed_tasks(tmp_path):
    """generate_tasks(rst_share=): each slot is either the rst_rounds=0 draw or the rst_rounds draw of that slot
    (drawn per slot), about a share of them extended; rst_share=1.0 draws what it drew before the option."""
    def instructions(name, **kw):
        tr, _ = data.generate_tasks(tmp_path / name, 60, 0, 2, validate_tasks=False, **kw)
        return [task_io.load_task(d).instruction for d in tr]
    seed, ext, share = instructions("s0", rst_rounds=0), instructions("s1", rst_rounds=1), instructions(
        "sh", rst_rounds=1, rst_share=0.5)
    assert sum(s != e for s, e in zip(seed, ext)) >= 40  # most slots have an RST step to add (47 of 60)
    picked = [x == e != s for x, s, e in zip(share, seed, ext)]
    assert all(x in (s, e) for x, s, e in zip(share, seed, ext))
    assert 15 <= sum(picked) <= 45  # Binomial(60, 0.5): outside this with probability < 1e-4
    assert instructions("again", rst_rounds=1, rst_share=1.0) == ext


@pytest.fixture(scope="module")
def rst_audited(tmp_path_factory):
    """An RST-extended text task, and the same task whose last step's test was dropped (its mutant passes)."""
    import random
    root = tmp_path_factory.mktemp("rst_ext")
    rng = random.Random(3)
    ext = families.rst_extend(families.fam_text(rng), "text", rng, 2)
    weak = dict(ext, tests=ext["tests"][:-1])  # the last step's (last) check gone: skipping that step passes
    dirs = {name: data.write_task(str(root / name), spec, "text", "train", "0")
            for name, spec in (("ext", ext), ("weak", weak))}
    work = str(root / "w")
    out = {}
    for name, d in dirs.items():
        reason, ref = data._validate(d, None, work)
        out[name] = (reason, rst.audit(d, work, reference=ref) if reason is None else None, ext)
    return out


def test_rst_task_is_verified_in_fresh_sandboxes_and_accepted(rst_audited):
    reason, a, ext = rst_audited["ext"]
    assert reason is None  # the oracle resolves with every test, nop does not
    assert a["reason"] is None and a["verdict"] in ("accepted", "borderline")
    assert a["dims"]["solution_necessity"] == 1.0  # every step's mutant fails a test


def test_rst_step_without_its_test_is_a_weak_verifier(rst_audited):
    reason, a, _ = rst_audited["weak"]
    assert reason is None
    assert [r.split(":")[0] for r in a["reasons"]] == ["weak_verifier"], a["reasons"]


# --- the optional LLM judge (rst.judge, `python data.py audit --judge URL`) ----------------------------------

class _Judge:
    """An OpenAI-compatible endpoint on 127.0.0.1 that answers every chat request with the next canned reply (a
    JSON verdict or junk), recording the requests: what a real judge model would be sent and would answer."""

    def __init__(self, replies):
        import http.server
        import threading
        self.replies, self.requests = list(replies), []
        judge = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append((self.path, body))
                text = judge.replies[(len(judge.requests) - 1) % len(judge.replies)]
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def _verdict(**over):
    v = {r: False for r in rst.REASONS}
    v["scores"] = {k: 0.9 for k in rst.WEIGHTS}
    v["repaired_instruction"] = None
    v.update(over)
    return "Here is my audit: " + json.dumps(v)


def test_judge_sends_the_rubric_and_task_and_combines_replies_by_majority(pool):
    _, train, _ = pool
    j = _Judge([_verdict(weak_verifier=True), _verdict(), _verdict(weak_verifier=True), "not json at all"])
    try:
        out = rst.judge(train[0], j.url, rounds=4, model="judge-7b")
    finally:
        j.server.shutdown()
    path, body = j.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge-7b" and len(j.requests) == 4
    rubric, task = body["messages"][0]["content"], body["messages"][1]["content"]
    assert "instruction_verifier_alignment 20%" in rubric and all(r in rubric for r in rst.REASONS)
    assert task_io.load_task(train[0]).instruction in task and "def test_" in task and "solve.sh" in task
    assert out["unparsable"] == 1 and out["verdict"] == "rejected"  # 2 of the 3 parsable replies: a majority
    assert out["reason"] == "weak_verifier: flagged by the judge in 2 of 3 replies"
    assert out["quality"] == pytest.approx(0.9)


def test_judge_without_a_parsable_reply_fails_loudly(pool):
    _, train, _ = pool
    j = _Judge(['{"hidden_requirement": "no"}', "junk"])
    try:
        out = rst.judge(train[0], j.url, rounds=2)
    finally:
        j.server.shutdown()
    assert out["verdict"] == "judge_failed" and out["quality"] is None
    assert out["reason"].startswith("judge_failed: no parsable reply in 2 (hidden_requirement: expected true")
    assert rst.judge(train[0], "http://127.0.0.1:9", rounds=1)["verdict"] == "judge_failed"  # nothing listening


def test_audit_cli_with_judge_prints_the_papers_statistics(pool, tmp_path):
    _, train, _ = pool
    j = _Judge([_verdict(repaired_instruction="Clearer text.")])
    try:
        rows, stats = data.audit_dirs(train[:2], j.url, judge_rounds=1)
    finally:
        j.server.shutdown()
    assert [r["verdict"] for r in rows] == ["accepted", "accepted"] and stats["instructions_repaired"] == 2
    j = _Judge([_verdict(test_leakage=True)])
    try:
        rows, stats = data.audit_dirs(train[:1], j.url, judge_rounds=1)
    finally:
        j.server.shutdown()
    assert rows[0]["verdict"] == "rejected" and stats["rejected_by_reason"] == {"test_leakage": 1}
    assert "rejected 1 (test_leakage 1)" in rst.format_stats(stats)[0]


def test_help_answers_before_torch_loads():
    """`python data.py --help` (and each command's) answers from a standard-library parser, before torch loads;
    every option's help line shows its default; the audit's judge rounds default is rst.JUDGE_ROUNDS."""
    for argv in (["data.py", "--help"], ["data.py", "generate", "--help"], ["data.py", "audit", "--help"]):
        code = (f"import runpy, sys\nsys.argv = {argv!r}\ntry:\n    runpy.run_path('data.py', run_name='__main__')\n"
                "except SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "TORCH False" in out.stdout, out.stderr[-2000:]
    audit = data.build_parser().parse_args(["audit", "x"])
    assert audit.judge_rounds == rst.JUDGE_ROUNDS and audit.workers == 2
    assert "(default: 15)" in " ".join(out.stdout.split())

