"""Harbor task I/O: load a task dir (Harbor's format, as data.py writes it or Terminal-Bench 2 ships it) and say
what the local jail cannot run of it (T1 paper, section "data"; the task format is data.py's docstring).

Run (in code; below rollout.py, which loads and runs tasks, and data.py, which writes and audits them):
    task_io.load_task(dir)  # also loads a Terminal-Bench 2 task dir unchanged (what it refuses: above load_task)
    task_io.image_needs(task)  # why the local jail cannot run a task faithfully ([] = it can; see its docstring)

A task dir is untrusted input read with bounds (paper silent; the caps below sit far above Terminal-Bench 2's tasks):
only regular files and directories, no links (symbolic or hard), files read through O_NOFOLLOW descriptors with a
size cap checked before reading, so loading a task never blocks, never follows a link and never reads without bound.
"""
import dataclasses
import importlib.metadata
import json
import math
import os
import re
import shlex
import shutil
import stat
import sys
import tomllib

# paper silent on all of these: caps on untrusted task dirs, sized well above Terminal-Bench 2 (in the few tasks
# checked: task.toml about 1 KiB, instruction.md under 2 KiB, timeouts 600 to 3600 s)
MAX_TOML_BYTES = 16 << 10  # task.toml (tomllib is quadratic in a dotted key's length: 16 KiB parse in under 1 s)
MAX_INSTRUCTION_BYTES = 256 << 10  # instruction.md (it becomes the agent's first prompt)
MAX_TASK_ENTRIES = 100_000  # files and directories in the whole task dir (limits.Limits.task_files per copied tree)
MAX_TASK_DEPTH = 64  # directory levels below the task dir (as host_fs.copy_task_tree)
MAX_TOML_DEPTH = 16  # nesting of tables and arrays in task.toml
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 24 * 3600.0  # every *timeout_sec in task.toml, in seconds
MAX_N_ASSERTIONS = 10_000  # [metadata] n_assertions / t1_audit.json (reward.compute's bound on P)
AUDIT_FILE = "t1_audit.json"  # data.validate() records n_assertions here for a task whose task.toml has none
AUDIT_MAX_BYTES = 4096
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


# --- Harbor task I/O ---------------------------------------------------------------------------
@dataclasses.dataclass
class Task:
    name: str
    path: str
    instruction: str
    config: dict
    tests_dir: str
    solution_dir: str | None
    env_dir: str
    n_assertions: int | None = None  # the task's assertion count recorded at audit (reward.compute's bound on P)


def _shown(path):
    """A path (or any name) as printable text: bytes that are not UTF-8 and control characters escaped."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _brief(value):
    """repr(value), cut to 60 characters (a message never carries a whole hostile value)."""
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _kind(mode):
    """What a file of this st_mode is, in words."""
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a device file"), (stat.S_ISBLK, "a device file"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISREG, "a regular file"))
    return next((what for test, what in kinds if test(mode)), f"a file of type {stat.S_IFMT(mode):#o}")


def _open_dir(name, dir_fd, path):
    """A directory's descriptor, opened without following a link; ValueError naming `path` otherwise."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise ValueError(f"{_shown(path)}: cannot be opened as a directory without following a link "
                         f"({e.strerror})") from None


def _check_tree(dir_fd, top, rel, depth, count):
    """Refuse anything below dir_fd (the directory top/rel) but directories and regular files with one link
    each: ValueError naming the path. At most MAX_TASK_ENTRIES entries in all (count[0]: so far) and MAX_TASK_DEPTH
    levels; entries are counted as they are listed, only directories are opened (O_NOFOLLOW), nothing is read."""
    if depth > MAX_TASK_DEPTH:
        raise ValueError(f"{_shown(os.path.join(top, rel))}: more than {MAX_TASK_DEPTH} directory levels below the "
                         f"task dir (MAX_TASK_DEPTH)")
    try:
        entries = os.scandir(dir_fd)
    except OSError as e:
        raise ValueError(f"{_shown(os.path.join(top, rel))}: cannot be listed ({e.strerror})") from None
    with entries:
        for entry in entries:
            path = os.path.join(top, rel, entry.name)
            count[0] += 1
            if count[0] > MAX_TASK_ENTRIES:
                raise ValueError(f"{_shown(top)}: more than {MAX_TASK_ENTRIES} files and directories in the task dir "
                                 f"(MAX_TASK_ENTRIES; at {_shown(path)})")
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as e:
                raise ValueError(f"{_shown(path)}: cannot be examined ({e.strerror})") from None
            if stat.S_ISDIR(st.st_mode):
                fd = _open_dir(entry.name, dir_fd, path)
                try:
                    _check_tree(fd, top, os.path.join(rel, entry.name), depth + 1, count)
                finally:
                    os.close(fd)
            elif stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(entry.name, dir_fd=dir_fd)
                except OSError:
                    target = "?"
                inside = os.path.normpath(os.path.join(rel, target))
                leaves = os.path.isabs(target) or inside == ".." or inside.startswith("../")
                raise ValueError(f"{_shown(path)}: not a regular file inside the task dir: a symbolic link to "
                                 f"{_shown(target)!r}{', which leaves the task dir' if leaves else ''} (a task dir "
                                 f"is read without following a link)")
            elif not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{_shown(path)}: not a regular file inside the task dir: {_kind(st.st_mode)}")
            elif st.st_nlink > 1:
                raise ValueError(f"{_shown(path)}: a file with {st.st_nlink} hard links (another of its names may be "
                                 f"a host file; a task dir holds its own copies)")


def _read_file(dir_fd, name, path, cap, cap_name):
    """The bytes of the regular file `name` in the directory dir_fd (None when it does not exist): opened without
    following a link and without blocking, its size checked against `cap` before reading, read from that descriptor
    only. ValueError naming `path` otherwise."""
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path}: cannot be opened without following a link ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: {_kind(st.st_mode)}, not a regular file")
        if st.st_nlink > 1:  # linked in after the walk
            raise ValueError(f"{path}: a file with {st.st_nlink} hard links (another of its names may be a host file)")
        if st.st_size > cap:
            raise ValueError(f"{path}: {st.st_size} bytes, over the cap of {cap} bytes ({cap_name})")
        data = b""
        while len(data) <= cap and (chunk := os.read(fd, cap + 1 - len(data))):
            data += chunk
        if len(data) > cap:
            raise ValueError(f"{path}: more than the cap of {cap} bytes ({cap_name}; it grew while read)")
        return data
    finally:
        os.close(fd)


def _utf8(data, path, what):
    """Bytes -> text; ValueError naming `path` when they are not UTF-8 or hold a NUL byte (binary data)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start} is {data[e.start:e.start + 1]!r}); {what}") from None
    if "\x00" in text:
        raise ValueError(f"{path}: holds NUL bytes at offset {text.index(chr(0))} (binary, not text); {what}")
    return text


def _positive_finite(value, where, maximum=None):
    """A positive finite number (int or float, not a bool) at most `maximum`; raise ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a positive finite number, got {_brief(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{where} = {value!r} is over the maximum of {maximum}")
    return value


def _timeout(value, where):
    """A timeout in seconds: a number (not a bool) in MIN_TIMEOUT_S..MAX_TIMEOUT_S; ValueError naming `where`."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not (ok and MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S):
        raise ValueError(f"{where} = {_brief(value)} is outside {MIN_TIMEOUT_S:g}..{MAX_TIMEOUT_S:g} s (a finite "
                         f"number of seconds, MIN_TIMEOUT_S..MAX_TIMEOUT_S)")
    return value


def _n_assertions(value, where):
    """A recorded assertion count: an int (not a bool) in 1..MAX_N_ASSERTIONS; raise ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N_ASSERTIONS:
        raise ValueError(f"{where} must be an integer in 1..{MAX_N_ASSERTIONS} (MAX_N_ASSERTIONS), got {_brief(value)}")
    return value


def _read_audit(root_fd, task_dir):
    """n_assertions recorded by data.validate() in AUDIT_FILE (None when there is none); ValueError when it is bad."""
    path = os.path.join(task_dir, AUDIT_FILE)
    raw = _read_file(root_fd, AUDIT_FILE, path, AUDIT_MAX_BYTES, "AUDIT_MAX_BYTES")
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict) or "n_assertions" not in doc:
        raise ValueError(f"{path}: expected a JSON object with n_assertions (at most {AUDIT_MAX_BYTES} bytes)")
    return _n_assertions(doc["n_assertions"], f"{path}: n_assertions")


def _parse_toml(raw, toml_path):
    """task.toml's bytes -> a dict of at most MAX_TOML_DEPTH levels; ValueError naming the file and the problem."""
    text = _utf8(raw, toml_path, "task.toml is TOML text")
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{toml_path}: invalid TOML ({_shown(str(e))[:200]})") from None
    except RecursionError:
        raise ValueError(f"{toml_path}: tables or arrays nested too deeply to parse (at most {MAX_TOML_DEPTH} "
                         f"levels, MAX_TOML_DEPTH)") from None
    stack = [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_TOML_DEPTH:
            raise ValueError(f"{toml_path}: tables or arrays nested more than {MAX_TOML_DEPTH} levels deep "
                             f"(MAX_TOML_DEPTH)")
        stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)
                  if isinstance(v, (dict, list))]
    return config


def _timeout_fields(value, table=""):
    """(where, value) of every key ending in timeout_sec, in any table or array of tables of task.toml."""
    items = value.items() if isinstance(value, dict) else ((f"{i}", v) for i, v in enumerate(value))
    for key, v in items:
        sub = f"{table}.{key}" if table and isinstance(value, dict) else f"{table}[{key}]" if table else key
        if isinstance(value, dict) and key.endswith("timeout_sec"):
            yield (f"[{table}] {key}" if table else key), v
        elif isinstance(v, (dict, list)) and not (isinstance(value, dict) and key == "env"):  # env: variables
            yield from _timeout_fields(v, sub)


def _check_config(config, toml_path):
    """Refuse the task.toml fields this project reads when they are the wrong type or out of range."""
    for table in ("metadata", "verifier", "agent", "environment", "solution"):
        if not isinstance(config.get(table, {}), dict):
            raise ValueError(f"{toml_path}: [{table}] must be a table, got {_brief(config[table])}")
    for where, value in _timeout_fields(config):  # every timeout: MIN_TIMEOUT_S..MAX_TIMEOUT_S seconds
        _timeout(value, f"{toml_path}: {where}")
    env, meta = config.get("environment", {}), config.get("metadata", {})
    for key in ("cpus", "memory_mb", "storage_mb"):  # read by sandbox/daytona.py
        if key in env:
            _positive_finite(env[key], f"{toml_path}: [environment] {key}")
    for table, key in (("metadata", "family"), ("metadata", "difficulty"), ("metadata", "split"),
                       ("metadata", "category"), ("environment", "docker_image")):
        if key in config.get(table, {}) and not isinstance(config[table][key], str):  # data.py / image_needs
            raise ValueError(f"{toml_path}: [{table}] {key} must be a string, got {_brief(config[table][key])}")
    if "quality" in meta:  # ordered_pool sorts by it
        q = meta["quality"]
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q):
            raise ValueError(f"{toml_path}: [metadata] quality must be a finite number, got {_brief(q)}")
    if "n_assertions" in meta:
        _n_assertions(meta["n_assertions"], f"{toml_path}: [metadata] n_assertions")


def _check_layout(root_fd, task_dir):
    """tests/ and environment/ are directories, tests/test.sh a regular file, solution/ a directory when present
    -> whether solution/ is there; ValueError naming the path otherwise."""
    def mode(rel):
        try:
            return os.stat(rel, dir_fd=root_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
    for rel, want, needed in (("tests", stat.S_ISDIR, True), ("tests/test.sh", stat.S_ISREG, True),
                              ("environment", stat.S_ISDIR, True), ("solution", stat.S_ISDIR, False)):
        m, path = mode(rel), os.path.join(task_dir, rel)
        if m is None and needed:
            raise ValueError(f"{path}: missing {rel}")
        if m is not None and not want(m):
            raise ValueError(f"{path}: {_kind(m)}, not a " + ("directory" if want is stat.S_ISDIR else "regular file"))
    return mode("solution") is not None


# load_task refuses (ValueError naming the file and the problem), before anything runs:
# - the tree: a task dir that is a link or whose path is not printable UTF-8; anywhere in it, a symbolic link, a
#   file with more than one hard link, a FIFO, a device file, a socket; more than MAX_TASK_ENTRIES entries or
#   MAX_TASK_DEPTH levels; a missing or wrong-typed task.toml, instruction.md, tests/, tests/test.sh, environment/
#   (a solution/ that is not a directory).
# - task.toml: over MAX_TOML_BYTES, not UTF-8, a NUL byte, not TOML, nested past MAX_TOML_DEPTH; [metadata] /
#   [verifier] / [agent] / [environment] / [solution] not tables; any *timeout_sec (any table) outside
#   MIN_TIMEOUT_S..MAX_TIMEOUT_S or not a finite number; [environment] cpus / memory_mb / storage_mb not positive
#   finite numbers; [metadata] family / difficulty / split / category and [environment] docker_image not strings;
#   a non-finite [metadata] quality; an n_assertions that is not an int in 1..MAX_N_ASSERTIONS.
# - instruction.md: over MAX_INSTRUCTION_BYTES, not UTF-8, a NUL byte, empty; t1_audit.json: over AUDIT_MAX_BYTES,
#   not JSON, a bad n_assertions, or one that disagrees with task.toml.
# Files are opened O_NOFOLLOW | O_NONBLOCK relative to the task dir's descriptor and read from that descriptor only,
# so a FIFO, /dev/zero or a sparse 100 GB file is refused without blocking or reading.
def load_task(task_dir):
    """Load a Harbor / Terminal-Bench 2 task dir; raise ValueError naming the bad file and the problem."""
    task_dir = os.path.abspath(task_dir)
    if _shown(task_dir) != task_dir:
        raise ValueError(f"task dir {_shown(task_dir)}: its path is not printable UTF-8 (it names the task in "
                         f"results and logs)")
    try:
        st = os.lstat(task_dir)
    except FileNotFoundError:
        raise ValueError(f"task dir {task_dir} does not exist") from None
    except OSError as e:
        raise ValueError(f"task dir {task_dir}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{task_dir}: the task dir is a symbolic link (to {_shown(os.readlink(task_dir))!r}); "
                         f"give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"task dir {task_dir} is not a directory ({_kind(st.st_mode)})")
    root_fd = _open_dir(task_dir, None, task_dir)
    try:
        _check_tree(root_fd, task_dir, "", 0, [0])
        toml_path = os.path.join(task_dir, "task.toml")
        raw = _read_file(root_fd, "task.toml", toml_path, MAX_TOML_BYTES, "MAX_TOML_BYTES")
        if raw is None:
            raise ValueError(f"{toml_path}: missing task.toml")
        config = _parse_toml(raw, toml_path)
        _check_config(config, toml_path)
        n_assertions = config.get("metadata", {}).get("n_assertions")
        audited = _read_audit(root_fd, task_dir)
        if n_assertions is not None and audited is not None and audited != n_assertions:
            raise ValueError(f"{toml_path}: [metadata] n_assertions = {n_assertions} but {AUDIT_FILE} records "
                             f"{audited}")
        ins_path = os.path.join(task_dir, "instruction.md")
        raw = _read_file(root_fd, "instruction.md", ins_path, MAX_INSTRUCTION_BYTES, "MAX_INSTRUCTION_BYTES")
        if raw is None:
            raise ValueError(f"{ins_path}: missing instruction.md")
        instruction = _utf8(raw, ins_path, "instruction.md is the agent's prompt").removeprefix("\ufeff").strip()
        if not instruction:
            raise ValueError(f"{ins_path}: instruction.md is empty")
        has_solution = _check_layout(root_fd, task_dir)
    finally:
        os.close(root_fd)
    return Task(name=os.path.basename(task_dir), path=task_dir, instruction=instruction, config=config,
                tests_dir=os.path.join(task_dir, "tests"),
                solution_dir=os.path.join(task_dir, "solution") if has_solution else None,
                env_dir=os.path.join(task_dir, "environment"),
                n_assertions=n_assertions if n_assertions is not None else audited)

# --- what the local jail can run -----------------------------------------------------------------
# the host's /usr stands in for these (sandbox/jail.py departure 1)
GENERIC_BASES = ("ubuntu", "debian", "python", "ghcr.io/laude-institute/t-bench/python",
                 "ghcr.io/laude-institute/t-bench/ubuntu")
_OPS = {"&&", "||", ";", "|", "&", "(", ")", "{", "}", ";;", "|&", "!"}
_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "time", "sudo", "exec", "nohup"}
_NETWORK = {"uvx": None, "pipx": None, "npx": None, "rustup": None, "apk": None, "yum": None, "dnf": None,
            "aptitude": None, "brew": None, "npm": {"install", "i", "ci", "add"}, "pnpm": {"install", "i", "add"},
            "yarn": {"install", "add"}, "conda": {"install", "create"}, "mamba": {"install", "create"},
            "cargo": {"install"}, "gem": {"install"}, "go": {"install", "get"},
            "git": {"clone", "fetch", "pull", "submodule"},
            "uv": {"add", "sync", "tool", "init", "python", "venv", "run", "self", "pip"}}  # None: any use


def _simple_commands(script):
    """Shell text -> the argv of each simple command (comments, line continuations, operators, keywords and
    VAR=value prefixes removed). A heuristic: no expansion, no here-documents."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        try:
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.commenters, lex.whitespace_split = "#", True
            words = list(lex)
        except ValueError:  # unbalanced quotes: plain words
            words = line.split()
        cmd = []
        for w in words + [";"]:
            if w in _OPS or (not cmd and (w in _KEYWORDS or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w))):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


CHECK_BYTES = 1 << 20  # a Dockerfile / test.sh above this is not parsed (image_needs asks for the image)


def _read_capped(path, task_dir):
    """A regular file's text up to CHECK_BYTES (None when longer); a link out of the task dir, a device or a FIFO
    raises ValueError naming it."""
    real, top = os.path.realpath(path), os.path.realpath(task_dir)
    if not real.startswith(top + os.sep) or not os.path.isfile(real):
        raise ValueError(f"{path}: not a regular file inside the task dir (-> {real})")
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except OSError as e:
        raise ValueError(f"{path}: cannot be opened without following a link ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file inside the task dir (-> {real})")
        data = f.read(CHECK_BYTES + 1)
    return None if len(data) > CHECK_BYTES else data.decode(errors="replace")


def _jail_has(tool):
    """Whether `tool` is on the jail's PATH (the running venv's bin, then the host's /usr/local/bin, /usr/bin)."""
    return shutil.which(tool, path=f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin") is not None


_GUARD = r"(?:command\s+-v|which|type\s+-[pP]|type|hash)\s+([^\s;|&]+)(?:>&|[^|&;])*"


def _lines_run_here(script):
    """The lines of a shell script that run in the jail, skipping installs guarded by a tool check that the jail
    answers: `command -v T || install`, `command -v T && use`, `if [!] command -v T ...; then ... [else ...] fi`
    (also which / type / hash), T looked up on the jail's PATH."""
    out, skip = [], []  # skip: per open guarded `if`, whether the current branch is skipped
    for line in script.replace("\\\n", " ").splitlines():
        m = re.match(r"\s*if\s+(!\s*)?" + _GUARD + r";?\s*(then)?\s*$", line)
        if m:
            skip.append(_jail_has(m.group(2)) == bool(m.group(1)))  # the then-branch does not run here
            continue
        if skip and re.match(r"\s*else\b", line):
            skip[-1] = not skip[-1]
            continue
        if skip and re.match(r"\s*fi\b", line):
            skip.pop()
            continue
        if any(skip):
            continue
        m = re.match(r"\s*" + _GUARD + r"(\|\||&&)(.*)$", line)
        if m:
            runs = _jail_has(m.group(1)) == (m.group(2) == "&&")
            line = m.group(3) if runs else ""
        out.append(line)
    return "\n".join(out)


def _host_debs():
    """Names of the Debian packages installed on this host (the jail's /usr), from dpkg's status file."""
    names, name = set(), None
    try:
        with open("/var/lib/dpkg/status") as f:
            for ln in f:
                if ln.startswith("Package: "):
                    name = ln.split()[1]
                elif ln.startswith("Status: ") and ln.split()[-1] == "installed" and name:
                    names.add(name)
    except OSError:
        pass
    return names


def _pip_unsatisfied(args):
    """The arguments of `pip install ARGS` that the running venv (bound into the jail) does not satisfy."""
    from packaging.requirements import InvalidRequirement, Requirement  # packaging comes with pytest
    bad, it = [], iter(args)
    for a in it:
        if a in ("-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url",
                 "--extra-index-url", "-f", "--find-links", "-t", "--target"):
            bad.append(f"{a} {next(it, '')}")  # a file, an index, a target: not checked, counted as unsatisfied
        elif a in ("-U", "--upgrade", "--force-reinstall"):
            bad.append(f"{a} (always fetches)")
        elif not a.startswith("-"):
            try:
                req = Requirement(a)
                have = importlib.metadata.version(req.name)
            except (InvalidRequirement, importlib.metadata.PackageNotFoundError):
                bad.append(a)
                continue
            if req.url or not req.specifier.contains(have, prereleases=True):
                bad.append(f"{a} (the venv has {have})")
    return bad


def _pip_args(argv):
    """ARGS of `pip install ARGS` / `python -m pip install ARGS` / `uv pip install ARGS`, else None."""
    prog, args = os.path.basename(argv[0]), argv[1:]
    if re.fullmatch(r"python[0-9.]*", prog) and args[:2] == ["-m", "pip"]:
        prog, args = "pip", args[2:]
    if prog == "uv" and args[:1] == ["pip"]:
        prog, args = "pip", args[1:]
    if re.fullmatch(r"pip[0-9.]*", prog) and args[:1] == ["install"]:
        return args[1:]
    return None


def _fetches(argv):
    """Why this command of test.sh (run in the jail: no network, no package manager state) needs the image."""
    prog, args = os.path.basename(argv[0]), argv[1:]
    cmd = " ".join(argv)
    if prog in ("apt-get", "apt") and any(a in ("install", "update", "upgrade", "dist-upgrade") for a in args):
        return f"`{cmd}` (no network and no package state in the jail)"
    if prog in ("curl", "wget"):
        remote = [a for a in args if re.match(r"(https?|ftp)://", a)
                  and not re.match(r"[a-z]+://(localhost|127\.|\[::1\]|0\.0\.0\.0)", a)]
        return f"`{cmd}` fetches {remote[0]}" if remote else None
    if prog in _NETWORK and (_NETWORK[prog] is None or (args and args[0] in _NETWORK[prog])):
        if _pip_args(argv) is None or prog == "uv":  # uv itself is fetched by such scripts (the host has none)
            return f"`{cmd}` (installs over the network)"
    pip = _pip_args(argv)
    if pip is not None and _pip_unsatisfied(pip):
        return f"`{cmd}` installs {', '.join(_pip_unsatisfied(pip))}, not in {sys.prefix}"
    return None


def _build_step(argv, debs):
    """Why this command of a Dockerfile RUN makes an image the jail does not have, or None when it only installs
    what this host's /usr (apt) and the running venv (pip) already provide."""
    prog, args = os.path.basename(argv[0]), argv[1:]
    cmd = " ".join(argv)
    if prog in ("rm", "true", ":") or (prog in ("apt-get", "apt") and args[:1] in (["update"], ["clean"])):
        return None
    if prog in ("apt-get", "apt") and "install" in args:
        pkgs = [a.split("=")[0] for a in args[args.index("install") + 1:] if not a.startswith("-")]
        missing = [p for p in pkgs if p not in debs and not shutil.which(p)]
        return f"`{cmd}` installs {', '.join(missing)}, not on this host" if missing else None
    pip = _pip_args(argv)
    if pip is not None:
        bad = _pip_unsatisfied(pip)
        return f"`{cmd}` installs {', '.join(bad)}, not in {sys.prefix}" if bad else None
    return f"`{cmd}` (a build step the jail does not run)"


def image_needs(task):
    """Why `task` needs its image built, so that the local bubblewrap jail cannot run it faithfully -> reasons
    ([] = it runs in the jail). The rule: a task scored here must not lose points to a tool it would have had.
    1. task.toml [environment] docker_image: the task names its own image.
    2. environment/Dockerfile: FROM a base other than GENERIC_BASES (the host's /usr stands in for those); a RUN
       command other than `apt-get update / install / clean` of packages this host has, `pip install` of
       requirements the running venv satisfies (a pinned version must match) and `rm`; COPY / ADD of anything
       but app/ to /app (the jail copies only environment/app), of a URL, or --from another stage; a WORKDIR
       other than /app. ENV, USER, ARG, LABEL, EXPOSE, CMD and ENTRYPOINT are not checked.
    3. tests/test.sh (run in the jail when verifying, without network): apt / apt-get install or update, curl /
       wget of a non-local URL, uv (pip / add / sync / run / tool ...), uvx, pipx, npm / conda / cargo / go / gem
       installs, git clone, and `pip install` of requirements the venv does not satisfy. So "install pytest if
       missing" (`pip install pytest pytest-json-ctrf`: satisfied, pip exits 0 offline) runs here, while
       Terminal-Bench 2's stock test.sh (apt-get install curl; curl the uv installer; uvx -w pytest ...) needs
       its image: in the jail it would fail before pytest and score 0. An install behind a tool check that the
       jail answers (`command -v pytest || pip install pytest==8.4.1`, `if ! command -v uv; then ...`) does not
       run here and is not counted.
    A heuristic over the shell text (no expansion, no here-documents); it errs towards asking for the image."""
    reasons, debs = [], None
    env = task.config.get("environment", {})
    if not isinstance(env, dict):
        raise ValueError(f"{os.path.join(task.path, 'task.toml')}: [environment] must be a table, got {env!r}")
    if env.get("docker_image"):
        reasons.append(f"task.toml [environment] docker_image = {env['docker_image']!r}")
    dockerfile = os.path.join(task.env_dir, "Dockerfile")
    if os.path.lexists(dockerfile):
        text = _read_capped(dockerfile, task.path)
        if text is None:
            reasons.append(f"Dockerfile larger than {CHECK_BYTES} bytes: not checked")
        lines = (text or "").replace("\\\n", " ").splitlines()
        for ln in (ln.strip() for ln in lines):
            op, _, rest = ln.partition(" ")
            op, rest = op.upper(), rest.strip()
            words = rest.split()
            if op == "FROM":
                base = next((w for w in words if not w.startswith("--")), "").split("@")[0]
                base = base.rsplit(":", 1)[0].removeprefix("docker.io/library/")
                if not any(base == g or base.startswith(g + "-") for g in GENERIC_BASES):  # python-3-13 too
                    reasons.append(f"Dockerfile FROM {rest} (the jail has this host's /usr, not that image)")
            elif op == "RUN":
                debs = _host_debs() if debs is None else debs
                reasons += [f"Dockerfile RUN {why}" for argv in _simple_commands(rest)
                            if (why := _build_step(argv, debs))]
            elif op == "WORKDIR" and rest.rstrip("/") != "/app":
                reasons.append(f"Dockerfile WORKDIR {rest} (the jail's working directory is /app)")
            elif op in ("COPY", "ADD"):
                srcs = [w.rstrip("/") for w in words[:-1]]
                if srcs != ["app"] or words[-1].rstrip("/") != "/app":
                    reasons.append(f"Dockerfile {op} {rest} (the jail copies only environment/app to /app)")
    test_sh = os.path.join(task.tests_dir, "test.sh")
    if os.path.lexists(test_sh):
        text = _read_capped(test_sh, task.path)
        if text is None:
            reasons.append(f"tests/test.sh larger than {CHECK_BYTES} bytes: not checked")
        script = _lines_run_here(text or "")
        reasons += [f"tests/test.sh {why}" for argv in _simple_commands(script) if (why := _fetches(argv))]
    return reasons
