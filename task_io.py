"""Harbor task I/O: load a task dir (Harbor's format, as data.py writes it or Terminal-Bench 2 ships it) and say
what the local jail cannot run of it (T1 paper, section "data"; the task format is data.py's docstring).

Run (in code; below rollout.py, which loads and runs tasks, and data.py, which writes and audits them):
    task_io.load_task(dir)  # also loads a Terminal-Bench 2 task dir unchanged (what it refuses: above load_task)
    task_io.image_needs(task)  # why the local jail cannot run a task faithfully ([] = it can; see its docstring)
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

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # paper silent: a task.toml timeout above a week is refused (threading caps waits)
AUDIT_FILE = "t1_audit.json"  # data.validate() records n_assertions here for a task whose task.toml has none
AUDIT_MAX_BYTES = 4096


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


def _positive_finite(value, where, maximum=None):
    """A positive finite number (int or float, not a bool) at most `maximum`; raise ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a positive finite number, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{where} = {value!r} is over the maximum of {maximum}")
    return value


def _n_assertions(value, where):
    """A recorded assertion count: a positive int (not a bool); raise ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")
    return value


def _read_audit(task_dir):
    """n_assertions recorded by data.validate() in AUDIT_FILE (None when there is none); ValueError when it is bad."""
    path = os.path.join(task_dir, AUDIT_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path}: cannot be opened without following a link ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        raw = f.read(AUDIT_MAX_BYTES + 1)
    try:
        doc = json.loads(raw) if len(raw) <= AUDIT_MAX_BYTES else None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict) or "n_assertions" not in doc:
        raise ValueError(f"{path}: expected a JSON object with n_assertions (at most {AUDIT_MAX_BYTES} bytes)")
    return _n_assertions(doc["n_assertions"], f"{path}: n_assertions")


def _check_config(config, toml_path):
    """Refuse the task.toml fields this project reads when they are the wrong type or out of range."""
    for table in ("metadata", "verifier", "agent", "environment"):
        if not isinstance(config.get(table, {}), dict):
            raise ValueError(f"{toml_path}: [{table}] must be a table")
    for table, key in (("verifier", "timeout_sec"), ("agent", "timeout_sec"), ("environment", "build_timeout_sec")):
        if key in config.get(table, {}):  # every timeout is finite: inf / nan / <= 0 / bool / str refused
            _positive_finite(config[table][key], f"{toml_path}: [{table}] {key} (seconds)", MAX_TIMEOUT_S)
    for key in ("cpus", "memory_mb", "storage_mb"):  # read by daytona_sandbox
        if key in config.get("environment", {}):
            _positive_finite(config["environment"][key], f"{toml_path}: [environment] {key}")
    meta = config.get("metadata", {})
    if "quality" in meta:  # ordered_pool sorts by it
        q = meta["quality"]
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q):
            raise ValueError(f"{toml_path}: [metadata] quality must be a finite number, got {q!r}")
    if "n_assertions" in meta:
        _n_assertions(meta["n_assertions"], f"{toml_path}: [metadata] n_assertions")


# load_task refuses (ValueError naming the file and field): [verifier] / [agent] timeout_sec and [environment]
# build_timeout_sec that are not positive finite numbers of at most MAX_TIMEOUT_S (inf, nan, 0, negatives, booleans,
# strings); [environment] cpus / memory_mb / storage_mb that are not positive finite numbers; a non-finite [metadata]
# quality; an n_assertions that is not a positive int; a t1_audit.json that disagrees with task.toml.
def load_task(task_dir):
    """Load a Harbor / Terminal-Bench 2 task dir; raise ValueError naming the bad file and field."""
    task_dir = os.path.abspath(task_dir)
    if not os.path.isdir(task_dir):
        raise ValueError(f"task dir {task_dir} does not exist")
    toml_path = os.path.join(task_dir, "task.toml")
    try:
        with open(toml_path, "rb") as f:
            config = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"{toml_path}: missing task.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{toml_path}: invalid TOML ({e})") from None
    _check_config(config, toml_path)
    n_assertions = config.get("metadata", {}).get("n_assertions")
    audited = _read_audit(task_dir)
    if n_assertions is not None and audited is not None and audited != n_assertions:
        raise ValueError(f"{toml_path}: [metadata] n_assertions = {n_assertions} but {AUDIT_FILE} records {audited}")
    ins_path = os.path.join(task_dir, "instruction.md")
    if not os.path.isfile(ins_path):
        raise ValueError(f"{ins_path}: missing instruction.md")
    with open(ins_path) as f:
        instruction = f.read().strip()
    if not instruction:
        raise ValueError(f"{ins_path}: instruction.md is empty")
    for rel in ("tests/test.sh", "environment"):
        if not os.path.exists(os.path.join(task_dir, rel)):
            raise ValueError(f"{os.path.join(task_dir, rel)}: missing {rel}")
    sol = os.path.join(task_dir, "solution")
    return Task(name=os.path.basename(task_dir), path=task_dir, instruction=instruction, config=config,
                tests_dir=os.path.join(task_dir, "tests"), solution_dir=sol if os.path.isdir(sol) else None,
                env_dir=os.path.join(task_dir, "environment"),
                n_assertions=n_assertions if n_assertions is not None else audited)


# --- what the local jail can run -----------------------------------------------------------------
# the host's /usr stands in for these (sandbox.py departure 1)
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
    with open(real, "rb") as f:
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
