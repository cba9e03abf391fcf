"""The task cache (T1_TASK_CACHE, tasks/pool_cache.py): a hit writes what the miss wrote, byte for byte and without
the cache's path; the key follows the arguments and the code; concurrent misses of one key generate once; a torn
entry is never used."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

import data
from tasks import pool_cache
from test_data import _tree  # {path relative to root: (bytes, mode)} of every file under root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIT = "[data] tasks from the cache"


def _pool(root):
    """_tree less the wall times summary.json records (two generations differ in those alone)."""
    files = _tree(root)
    summary = json.loads(files.pop("summary.json")[0])
    summary.pop("seconds")
    for k in ("seconds_per_task", "audit_seconds_per_task"):
        summary["audit"].pop(k, None)
    return files, summary


def _entries(cache):
    return sorted(n for n in os.listdir(cache) if not n.endswith(".lock"))


def _args(monkeypatch, *a, **kw) -> dict:
    """The arguments generate_tasks hands the cache for this call (nothing generated)."""
    seen = {}
    with monkeypatch.context() as mp:
        mp.setattr(pool_cache, "cached", lambda out_dir, args, generate: seen.update(args) or ([], []))
        data.generate_tasks("unused", *a, **kw)
    return seen


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="the sandbox audit needs root and bwrap")
def test_a_hit_writes_what_the_miss_wrote(tmp_path, monkeypatch, capsys):
    """A sandbox-audited pool (the audit writes quality and verdict into task.toml): the second call copies it, the
    same files with the same bytes and modes, returned under its own out_dir, no path of the cache in any file."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("T1_TASK_CACHE", str(cache))
    a_train, a_held = data.generate_tasks(tmp_path / "a", 1, 1, seed=12, scripted=False)
    assert HIT not in capsys.readouterr().out and len(_entries(cache)) == 1
    b_train, b_held = data.generate_tasks(tmp_path / "b", 1, 1, seed=12, scripted=False, workers=1)  # workers: no key
    assert HIT in capsys.readouterr().out and len(_entries(cache)) == 1
    assert [os.path.relpath(d, tmp_path / "a") for d in a_train + a_held] == \
        [os.path.relpath(d, tmp_path / "b") for d in b_train + b_held]
    assert all(d.startswith(str(tmp_path / "b")) and os.path.isdir(d) for d in b_train + b_held)
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    assert a == b and "summary.json" in a and any('audit = "' in v[0].decode() for k, v in a.items()
                                                   if k.endswith("task.toml"))
    assert not [k for k, (v, _) in b.items() if str(cache).encode() in v]


def test_the_key_follows_every_argument_but_workers_and_the_code(tmp_path, monkeypatch):
    base = _args(monkeypatch, 6, 3, 5)
    key = pool_cache.pool_key(base)
    assert pool_cache.pool_key(_args(monkeypatch, 6, 3, 5, workers=7)) == key
    changed = [_args(monkeypatch, 7, 3, 5), _args(monkeypatch, 6, 4, 5), _args(monkeypatch, 6, 3, 6),
               _args(monkeypatch, 6, 3, 5, validate_tasks=False), _args(monkeypatch, 6, 3, 5, scripted=False),
               _args(monkeypatch, 6, 3, 5, rst_rounds=1), _args(monkeypatch, 6, 3, 5, validate_train=False),
               _args(monkeypatch, 6, 3, 5, expert_text="terse"), _args(monkeypatch, 6, 3, 5, heldout_split="val"),
               _args(monkeypatch, 6, 3, 5, avoid={"x"}), _args(monkeypatch, 6, 3, 5, rst_share=0.5)]
    keys = {pool_cache.pool_key(a) for a in changed}
    assert len(keys) == len(changed) and key not in keys
    assert pool_cache.pool_key(_args(monkeypatch, 6, 3, 5, avoid={"b", "a"})) == pool_cache.pool_key(
        _args(monkeypatch, 6, 3, 5, avoid=["a", "b", "a"]))  # a set of instructions: order and repeats aside
    src = pool_cache.sources()  # what writes and audits a task: the families, the audit, the sandbox, the verifier
    assert {"data.py", "tasks/families.py", "tasks/rst.py", "tasks/pool_cache.py", "rollout.py", "reward.py",
            "model.py", "terminus2.py", "sandbox/jail.py", "sandbox/verifier_report_plugin.py"} <= set(src)
    assert "train_t1.py" not in src and "ppo.py" not in src and not [s for s in src if s.startswith("tests")]
    copy = tmp_path / "root"
    for rel in src:
        os.makedirs(copy / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), copy / rel)
    assert pool_cache.pool_key(base, root=str(copy)) == key
    for rel in ("tasks/families.py", "sandbox/verifier_report_plugin.py"):
        with open(copy / rel, "a") as f:
            f.write("\n# changed\n")
        assert pool_cache.pool_key(base, root=str(copy)) != key
        key = pool_cache.pool_key(base, root=str(copy))


def _start(out, cache):
    code = "import sys, data; data.generate_tasks(sys.argv[1], 12, 6, seed=21, validate_tasks=False)"
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=dict(os.environ, T1_TASK_CACHE=str(cache)))
    lines = []
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    return p, lines


def test_concurrent_misses_of_one_key_generate_once(tmp_path, monkeypatch):
    """Two processes miss the same key while a third holds its lock: both wait; then one generates and stores, the
    other copies its entry; both pools are the same files."""
    cache = tmp_path / "cache"
    cache.mkdir()
    key = pool_cache.pool_key(_args(monkeypatch, 12, 6, 21, validate_tasks=False))
    with pool_cache._locked(str(cache / f"{key}.lock")):
        procs = [_start(tmp_path / name, cache) for name in "ab"]
        deadline = time.time() + 300
        while not all(any("waiting for the task cache lock" in ln for ln in lines) for _, lines in procs):
            assert time.time() < deadline and all(p.poll() is None for p, _ in procs), procs
            time.sleep(0.2)
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    for p, _ in procs:
        assert p.wait(timeout=300) == 0
    time.sleep(0.2)  # the readers' last lines
    hits = [any(HIT in ln for ln in lines) for _, lines in procs]
    assert sorted(hits) == [False, True], [lines for _, lines in procs]
    assert _entries(cache) == [key] and _tree(tmp_path / "a") == _tree(tmp_path / "b")


def test_a_torn_entry_is_never_used(tmp_path, monkeypatch, capsys):
    """An entry missing a file, one with a file cut short, and a folder left by a store that died before its rename
    are each ignored: the pool is generated again (the same files) and the entry replaced whole."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("T1_TASK_CACHE", str(cache))
    data.generate_tasks(tmp_path / "a", 6, 3, seed=22, validate_tasks=False)
    (key,) = _entries(cache)
    entry = cache / key
    good = _pool(tmp_path / "a")
    task = sorted((entry / "train").iterdir())[0]
    breaks = [lambda: (entry / pool_cache.MANIFEST).unlink(),
              lambda: (task / "instruction.md").write_text("cut"),
              lambda: (task / "tests" / "test_outputs.py").unlink()]
    for i, brk in enumerate(breaks):
        capsys.readouterr()
        brk()
        out = tmp_path / f"again{i}"
        data.generate_tasks(out, 6, 3, seed=22, validate_tasks=False)
        assert HIT not in capsys.readouterr().out and _pool(out) == good
        assert _entries(cache) == [key] and _tree(entry) != {}
    shutil.copytree(entry, cache / f".tmp-{key}-dead")  # a store that died before its rename
    shutil.rmtree(entry)
    (cache / f".tmp-{key}-dead" / "summary.json").write_text("{}")
    data.generate_tasks(tmp_path / "fresh", 6, 3, seed=22, validate_tasks=False)
    assert HIT not in capsys.readouterr().out and _pool(tmp_path / "fresh") == good
    data.generate_tasks(tmp_path / "hit", 6, 3, seed=22, validate_tasks=False)
    assert HIT in capsys.readouterr().out and _pool(tmp_path / "hit") == good
