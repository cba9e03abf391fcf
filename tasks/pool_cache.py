"""Task pools cached by what decides them (data.generate_tasks; the environment variable T1_TASK_CACHE=DIR).

A pool is a pure function of generate_tasks' arguments (all but `workers`) and of the code that writes and audits
it: data.py and every project module it imports, transitively (read from the source, not from what is loaded),
with every file of each package reached (the sandbox runs some of its files by path), plus the Python, the
tokenizer / verifier packages' versions, whether this process is root and which bwrap it finds (the sandbox audit
refuses without them). Any change to one of these is a new key: a stale pool is never reused.

DIR/<key>/ holds a pool as generate_tasks wrote it (its split folders and summary.json) and MANIFEST (the returned
task dirs, every file's size), written last; the entry is built in a temporary folder and renamed into place
whole, so a folder at a key's name is complete, and one whose files disagree with its MANIFEST is regenerated.
A miss generates under an exclusive lock on DIR/<key>.lock (fcntl.flock): of several processes missing one key at
once, one generates and the others wait, then copy. A hit copies the entry's folders into out_dir (nothing in a
pool names where it was written, so the copy is what generate_tasks would have written there).
"""
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import uuid

ENV = "T1_TASK_CACHE"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "MANIFEST.json"
VERSIONS = ("tokenizers", "transformers", "pytest", "pytest-json-ctrf")  # the scripted check's tokenizer, verifier


def _module_file(root, name):
    """The file of project module `name` ('a.b') under root, or None (not a project module)."""
    base = os.path.join(root, *name.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(p):
            return p
    return None


IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([\w.]+(?:[ \t]*,[ \t]*[\w.]+)*))", re.M)


def _imported(path):
    """The module names one file's import statements name (`from a.b import c`: 'a.b'; a package reached is taken
    whole, so the names after `import` of a from-import need no reading). A line-wise scan, not a parse: a name it
    takes wrongly only adds a file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [n.strip() for m in IMPORT.finditer(text) for n in (m.group(1) or m.group(2)).split(",")]


def sources(root=ROOT, entry="data.py") -> list:
    """The files whose code decides a pool: entry and the project modules it imports, transitively, with every
    *.py of each package reached (and the packages' __init__.py); relative to root, sorted."""
    todo, seen = [os.path.join(root, entry)], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        rel = os.path.relpath(path, root)
        if os.sep in rel:  # a package's module: its whole folder (and the folders above it up to root)
            pkg = os.path.dirname(path)
            while pkg != root:
                todo += [os.path.join(pkg, n) for n in sorted(os.listdir(pkg)) if n.endswith(".py")]
                pkg = os.path.dirname(pkg)
        for name in _imported(path):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # 'a.b' reaches a/__init__.py (then all of a/) and a/b.py
                f = _module_file(root, ".".join(parts[:i]))
                if f is not None:
                    todo.append(f)
    return sorted(os.path.relpath(p, root) for p in seen)


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def pool_key(args: dict, root=ROOT) -> str:
    """The digest of a pool's arguments (json: sets as sorted lists) and of everything else that decides it."""
    h = hashlib.sha256()
    env = dict(python=sys.version, versions={p: _version(p) for p in VERSIONS}, root_user=os.geteuid() == 0,
               bwrap=shutil.which("bwrap"))
    h.update(json.dumps(dict(args=args, env=env), sort_keys=True, default=_plain).encode())
    for rel in sources(root):
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f"\0{rel}\0".encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]


def _plain(x):
    """json default: a set as its sorted items, a path or number type as its string."""
    return sorted(x) if isinstance(x, (set, frozenset)) else str(x)


def _files(top):
    """{path relative to top: size} of every file under top."""
    out = {}
    for d, _, names in os.walk(top):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, top)] = os.path.getsize(p)
    return out


def _complete(entry):
    """The entry's MANIFEST when the entry is whole (every file it lists there, at its size), else None."""
    try:
        with open(os.path.join(entry, MANIFEST)) as f:
            man = json.load(f)
        files = _files(entry)
        files.pop(MANIFEST)
        return man if files == man["files"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _copy_out(entry, man, out_dir):
    """Copy an entry's pool into out_dir as generate_tasks writes it (a task dir of the same name is replaced)."""
    out_dir = str(out_dir)
    for rel in man["train"] + man["heldout"]:
        dst = os.path.join(out_dir, *rel.split("/"))
        if os.path.lexists(dst):
            shutil.rmtree(dst)
        shutil.copytree(os.path.join(entry, *rel.split("/")), dst, symlinks=True)
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy2(os.path.join(entry, "summary.json"), os.path.join(out_dir, "summary.json"))
    return ([os.path.join(out_dir, *rel.split("/")) for rel in man["train"]],
            [os.path.join(out_dir, *rel.split("/")) for rel in man["heldout"]])


def _store(cache, key, out_dir, train, heldout):
    """Copy a pool just generated into cache/key: built in a temporary folder, MANIFEST last, renamed into place (an
    invalid entry already there is moved aside first). A failure to store leaves the cache as it was."""
    out_dir = str(out_dir)
    rel = lambda d: os.path.relpath(d, out_dir).replace(os.sep, "/")  # noqa: E731
    man = dict(train=[rel(d) for d in train], heldout=[rel(d) for d in heldout])
    tmp = os.path.join(cache, f".tmp-{key}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        for r in man["train"] + man["heldout"]:
            shutil.copytree(os.path.join(out_dir, *r.split("/")), os.path.join(tmp, *r.split("/")), symlinks=True)
        shutil.copy2(os.path.join(out_dir, "summary.json"), os.path.join(tmp, "summary.json"))
        man["files"] = {k.replace(os.sep, "/"): v for k, v in _files(tmp).items()}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(man, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        entry = os.path.join(cache, key)
        if os.path.lexists(entry):
            old = os.path.join(cache, f".old-{key}-{uuid.uuid4().hex[:8]}")
            os.rename(entry, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, entry)
    except OSError as e:
        print(f"[data] the task cache could not store {key}: {e}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(path):
    """An exclusive flock on path (created), said when another process holds it."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[data] waiting for the task cache lock {path}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(out_dir, args: dict, generate):
    """generate() -> (train_dirs, heldout_dirs) written under out_dir, through the cache when T1_TASK_CACHE is set:
    a complete entry for pool_key(args) is copied into out_dir, else generate() runs (one process per key at a
    time) and its pool is stored."""
    cache = os.environ.get(ENV)
    if not cache:
        return generate()
    cache = os.path.abspath(cache)
    os.makedirs(cache, exist_ok=True)
    key = pool_key(args)
    entry = os.path.join(cache, key)

    def hit(man):
        train, heldout = _copy_out(entry, man, out_dir)
        print(f"[data] tasks from the cache ({ENV}) {entry}: {len(train)} train, {len(heldout)} "
              f"{args.get('heldout_split', 'heldout')} -> {out_dir}", flush=True)
        return train, heldout
    if (man := _complete(entry)) is not None:
        return hit(man)
    with _locked(os.path.join(cache, key + ".lock")):
        if (man := _complete(entry)) is not None:  # another process generated it while this one waited
            return hit(man)
        train, heldout = generate()
        _store(cache, key, out_dir, train, heldout)
    return train, heldout
