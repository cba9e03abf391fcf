"""The task families, RST's operation library and the expert's replies (T1 paper, section "data": the seed tasks and
their recursive rewriting; data.py writes, audits and pools what these draw).

A family is rng -> spec: the instruction, the initial /app files, the tests [(name, [assert lines])], the expert's
turns (analysis, plan, commands: the reference solution), the final analysis and the outputs the tests read.
rst_extend(spec, family, rng, rounds) is RST's recursive rewriting: extend the executable path by one operation of
RST_OPS, then append that step to the instruction. expert_replies(spec, text) are the expert's Terminus-2 replies.
Every spec records its template: "family/kind" (the instruction template drawn: text/count, files/move or files/copy,
perms/script or perms/modes, ...) plus "+op" per RST step ("text/count+gzip+backup"); data.write_task stores it.

Vocabularies: every name and value a family or an RST op draws comes from the vocabulary its rng carries
(VocabRandom(seed, vocab).vocab; a plain random.Random draws from TRAIN). TRAIN is the pools and shapes the
generator always drew (word + 2 digits + .txt / .log / .key, suffixes _dir / _backup / ..., the csv numbers 10-89,
its modes): a TRAIN draw is byte-identical to a random.Random draw of the same seed. UNSEEN shares no word, person,
city, colour or column name with it, and its shapes differ: stems of word, '-' / '_' / nothing and 1 or 3 digits
(quasar7, nimbus_204, obelisk-318), .dat / .rec / .pem for .txt / .log / .key, suffixes -folder / -spare / ...,
numbers with one digit more, other modes. Kept in both, because the instruction or the tool relies on them: the log
levels (ERROR / WARN / INFO / DEBUG, what grep counts), the extensions .csv / .json / .tar.gz / .gz / .sh (they say
which tool reads the file), the csv / json keys name and city (the template's fields), mode 444 (read-only's
meaning), the fixed words of the perms contents ("hello", "secret-") and contents only a verifier reads (log lines'
dates and numbers, the sum kind's columns).

Departures from the paper (data.py numbers them 1 and 4):
1. No LLM: 6 templated families of real shell work (files/dirs, text processing, permissions, archives, CSV/JSON,
   find-then-act) with randomised parameters are the seeds; RST's rewriting appends "... Then <step>." with a step
   of a fixed library (RST_OPS) instead of an LLM composing and rewriting; the files family has no file to extend.
2. Instructions and expert replies are short and formulaic: the embedded policy is a ~2.5M parameter model trained
   from scratch on CPU (--expert-text terse makes the replies' free text the same fixed words on every task).
3. The find family's expert hands the path it finds to mv / cp by command substitution, in one command: the
   miniature never learned to copy a path off the terminal into its next command (results/LOG.md).
4. Likewise the CSV expert's awk finds the column by the name the instruction gives (`-v c=score`, the header
   read in the same program), where it read the header first and copied the column number into a second command.

Every expert command prints the same text in two runs of one seed (no clock, no trial uid: the perms expert shows
modes with `stat -c '%A %n'`, not `ls -l`). Until 2026-12-03 the static audit refused every draw of the perms
family's modes kind (its files change in place: spec "edits"), so every perms task of earlier runs wrote a script.
"""
import dataclasses
import gzip
import io
import json
import os
import random
import re
import tarfile

WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
         "juniper", "kestrel", "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven",
         "sable", "tundra", "umber", "velvet", "willow", "yarrow", "zephyr", "birch", "comet",
         "dune", "fjord", "grove"]
COLORS = ["red", "blue", "green", "black", "white", "amber", "olive", "coral", "ivory", "teal"]
PEOPLE = ["ana", "ben", "cara", "dan", "eve", "finn", "gia", "hugo", "ines", "jon", "kai", "lea",
          "mia", "noah", "omar", "pia", "raj", "sara", "tom", "uma", "vera", "will", "zoe"]
CITIES = ["oslo", "lima", "rome", "kyiv", "doha", "nice", "bern", "riga", "turin", "porto"]
LEVELS = ["ERROR", "WARN", "INFO", "DEBUG"]

DIFFICULTY = {"files": "easy", "text": "easy", "perms": "easy", "archive": "easy",
              "csvjson": "medium", "find": "medium"}


# --- vocabularies: where every name and value of a draw comes from -------------------------------------------
@dataclasses.dataclass(frozen=True)
class Vocab:
    """The names and values a family or an RST op draws. `stem` draws a name's stem (maple42), `ext` maps a role's
    extension to this vocabulary's, `suffix` a directory's role to its suffix; n3 / n4 draw a 3- / 4-digit-shaped
    number (file contents, the grep and script words); `values` the csv/json numbers; the modes perms asks for."""
    name: str
    words: tuple
    colors: tuple
    people: tuple
    cities: tuple
    columns: tuple
    values: range
    key_modes: tuple
    dir_modes: tuple
    ext: dict
    suffix: dict
    stem: object
    n3: object
    n4: object


def _train_stem(rng):  # word + 2 digits: maple42
    return f"{rng.choice(TRAIN.words)}{rng.randint(10, 99)}"


def _unseen_stem(rng):  # word, '-' / '_' / nothing, 1 or 3 digits (never training's 2): quasar7, nimbus_204, orbit-5
    w, sep = rng.choice(UNSEEN.words), rng.choice(("-", "_", ""))
    return f"{w}{sep}{rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(100, 999)}"


TRAIN = Vocab("train", tuple(WORDS), tuple(COLORS), tuple(PEOPLE), tuple(CITIES), ("age", "score", "points"),
              range(10, 90), ("600", "640", "400"), ("700", "750", "711"),
              dict(txt="txt", log="log", key="key", sh="sh", csv="csv", json="json"),
              dict(dir="_dir", private="_private", docs="_docs", files="_files", data="_data", backup="_backup"),
              _train_stem, lambda rng: rng.randint(100, 999), lambda rng: rng.randint(1000, 9999))
UNSEEN = Vocab("unseen",
               ("quasar", "obelisk", "nimbus", "arbor", "basalt", "cobalt", "dynamo", "eclipse", "fathom", "gossamer",
                "helix", "isotope", "jasper", "krypton", "lagoon", "mosaic", "nebula", "orbit", "prism", "quiver",
                "rhombus", "saffron", "tarsus", "uplink", "vortex", "wombat", "xenon", "yonder", "zenith", "bramble"),
               ("cyan", "mauve", "ochre", "khaki", "plum", "rust", "sepia", "slate", "taupe", "lilac"),
               ("ada", "bo", "cyd", "dov", "elif", "fay", "gus", "hal", "ivo", "jade", "kit", "lars", "mona", "nils",
                "ola", "pax", "quin", "rosa", "sven", "tess", "ugo", "vik", "wren"),
               ("accra", "baku", "cusco", "dakar", "faro", "graz", "hanoi", "izmir", "kobe", "lyon"),
               ("weight", "height", "votes"), range(100, 1000), ("660", "604", "440"), ("770", "705", "751"),
               dict(txt="dat", log="rec", key="pem", sh="sh", csv="csv", json="json"),
               dict(dir="-folder", private="-vault", docs="-papers", files="-unpacked", data="-store", backup="-spare"),
               _unseen_stem, lambda rng: rng.randint(1000, 9999), lambda rng: rng.randint(10000, 99999))
VOCABS = {"train": TRAIN, "unseen": UNSEEN}


class VocabRandom(random.Random):
    """A random.Random carrying the vocabulary its draws take names and values from (`.vocab`); a plain
    random.Random draws from TRAIN. The same seed gives the same sequence of numbers as random.Random(seed)."""

    def __init__(self, seed=None, vocab="train"):
        if not isinstance(vocab, Vocab) and vocab not in VOCABS:  # a Vocab: a made-up one (tasks/copying.py)
            raise ValueError(f"VocabRandom: vocab must be a Vocab or one of {sorted(VOCABS)}, got {vocab!r}")
        super().__init__(seed)
        self.vocab = vocab if isinstance(vocab, Vocab) else VOCABS[vocab]


def vocab_of(rng) -> Vocab:
    """The vocabulary rng draws from (TRAIN unless a VocabRandom says otherwise)."""
    return getattr(rng, "vocab", TRAIN)


# --- helpers for the families -----------------------------------------------------------------
def _names(rng, k, ext):
    """k distinct names like maple42.txt (the vocabulary's stems; ext: the role's extension, mapped by it)."""
    v = vocab_of(rng)
    out = []
    while len(out) < k:
        n = v.stem(rng) + (f".{v.ext[ext]}" if ext else "")
        if n not in out:
            out.append(n)
    return out


def _dir(rng, role):
    """A new directory's name: a stem and the vocabulary's suffix for its role (maple42_backup)."""
    return _names(rng, 1, "")[0] + vocab_of(rng).suffix[role]


def _text(rng, n_lines, per_line=(3, 6)):
    words = vocab_of(rng).words
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(*per_line))) + "\n"
                   for _ in range(n_lines))


def _turn(analysis, plan, cmds):
    return dict(analysis=analysis, plan=plan, cmds=cmds)


def _spec(instruction, files, tests, turns, done, outputs, edits=(), *, template):
    """A family's output: app files {relpath: str|bytes}, tests [(name, [lines])], expert turns
    (the solution is their commands), final analysis, outputs the tests read (named in the text), and which of them
    are app files the task changes in place (data.static_audit's "already in /app" rule skips those; the nop
    check of data.validate is what shows a changed-in-place output is not already right); template: "family/kind",
    the instruction template drawn (rst_extend appends "+op" per step)."""
    return dict(instruction=instruction, files=files, tests=tests, turns=turns, done=done,
                outputs=list(outputs), edits=list(edits), template=template)


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
    v = vocab_of(rng)
    d = _dir(rng, "dir")
    f1, f2, f3, f4 = _names(rng, 4, "txt")
    body = {f: f"{rng.choice(v.words)} {v.n3(rng)}\n" for f in (f1, f2, f3, f4)}
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
    done = f"{f1} and {f2} are in {d} and {f3} is gone."
    return _spec(ins, body, tests, turns, done, [d], template=f"files/{op}")


def fam_text(rng):
    v = vocab_of(rng)
    kind = rng.choice(["count", "uniq", "replace", "sum", "words"])
    src, out = _names(rng, 2, "txt")
    if kind == "count":
        src = src.rsplit(".", 1)[0] + "." + v.ext["log"]
        lines = [f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)} {rng.choice(LEVELS)} "
                 f"{rng.choice(v.words)} {rng.randint(1, 99)}" for _ in range(rng.randint(8, 16))]
        level = rng.choice(sorted({ln.split()[1] for ln in lines}))  # >= 1 match: grep -c exits 0
        n = sum(level in ln for ln in lines)
        files, cmd = {src: "\n".join(lines) + "\n"}, f"grep -c {level} {src} > {out}"
        ins = f"Count the lines in {src} that contain {level} and write the number to {out}."
        checks = [("count_correct", [f"assert int(_read({out!r}).strip()) == {n}"])]
        done = f"{out} holds the count {n}."
    elif kind == "uniq":
        pool = rng.sample(v.words, rng.randint(4, 7))
        words = [rng.choice(pool) for _ in range(rng.randint(10, 18))]
        files, cmd = {src: "\n".join(words) + "\n"}, f"sort -u {src} > {out}"
        ins = f"Write the unique lines of {src}, sorted, to {out}."
        checks = [("lines_sorted", [f"assert _lines({out!r}) == sorted(_lines({out!r}))"]),
                  ("lines_unique", [f"ls = _lines({out!r})", "assert len(ls) == len(set(ls))"]),
                  ("same_words", [f"assert set(_lines({out!r})) == set({sorted(set(words))!r})"])]
        done = f"{out} has the {len(set(words))} unique lines in order."
    elif kind == "replace":
        old, new = rng.choice(v.words), rng.choice(v.colors)
        content = _text(rng, rng.randint(5, 9))
        while old not in content:
            content += f"{old} {rng.choice(v.words)}\n"
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
        rows = [[rng.choice(v.people), rng.randint(1, 50), rng.randint(1, 50)] for _ in range(rng.randint(4, 9))]
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
    return _spec(ins, files, tests, turns, done, [out], template=f"text/{kind}")


def fam_perms(rng):
    v = vocab_of(rng)
    if rng.random() < 0.4:  # write a script and make it executable
        s = _names(rng, 1, "sh")[0]
        w = f"{rng.choice(v.words)}-{v.n3(rng)}"
        tests = [("script_exists", [f"assert os.path.isfile(A + '/{s}')"]),
                 ("script_executable", [f"assert _mode({s!r}) & stat.S_IXUSR"]),
                 ("script_prints_word", [f"r = subprocess.run([A + '/{s}'], capture_output=True, text=True, "
                                         "timeout=10)",
                                         f"assert r.stdout.strip() == {w!r}"])]
        turns = [_turn(f"I need a script {s} in /app that prints {w}.", "Write it with printf, then chmod +x.",
                       [f"printf '#!/bin/sh\\necho {w}\\n' > {s}", f"chmod +x {s}", f"./{s}"])]
        ins = f"Create the script {s} in /app that prints {w}, and make it executable."
        return _spec(ins, {}, tests, turns, f"{s} prints {w}.", [s], template="perms/script")
    s = _names(rng, 1, "sh")[0]
    k, = _names(rng, 1, "key")
    d = _dir(rng, "private")
    w = f"hello {rng.choice(v.words)}"
    km, dm = rng.choice(v.key_modes), rng.choice(v.dir_modes)
    files = {s: f"#!/bin/sh\necho {w}\n", k: f"secret-{v.n4(rng)}\n"}
    tests = [("script_executable", [f"assert _mode({s!r}) & stat.S_IXUSR"]),
             ("script_runs", [f"r = subprocess.run([A + '/{s}'], capture_output=True, text=True, timeout=10)",
                              f"assert r.stdout.strip() == {w!r}"]),
             ("key_mode", [f"assert _mode({k!r}) == 0o{km}"]),
             ("dir_created", [f"assert os.path.isdir(A + '/{d}')"]),
             ("dir_mode", [f"assert _mode({d!r}) == 0o{dm}"])]
    turns = [_turn(f"I need to fix permissions in /app: {s}, {k} and a new dir {d}.",
                   "Use chmod and mkdir -m, then show the modes.",
                   [f"chmod +x {s}", f"chmod {km} {k}", f"mkdir -m {dm} {d}", f"stat -c '%A %n' {s} {k} {d}"])]
    ins = f"In /app, make {s} executable, set {k} to mode {km}, and create the directory {d} with mode {dm}."
    return _spec(ins, files, tests, turns, f"Modes are set: {s} +x, {k} {km}, {d} {dm}.", [s, k, d], edits=[s, k],
                 template="perms/modes")


def fam_archive(rng):
    v = vocab_of(rng)
    kind = rng.choice(["create", "extract", "gzip"])
    members = {f: f"{rng.choice(v.words)} {v.n3(rng)}\n" for f in _names(rng, rng.randint(2, 3), "txt")}
    first = sorted(members)[0]
    a = _names(rng, 1, "")[0]
    if kind == "create":
        d = _dir(rng, "docs")
        path = f"A + '/{a}.tar.gz'"
        names = f"[n.lstrip('./') for n in tarfile.open({path}, 'r:gz').getnames()]"
        tests = [("archive_exists", [f"assert os.path.isfile({path})"]),
                 ("archive_is_tar_gz", [f"assert tarfile.open({path}, 'r:gz').getnames()"]),
                 ("archive_has_files", [f"assert {sorted(d + '/' + f for f in members)!r} == "
                                        f"sorted(n for n in {names} if n.endswith('.{v.ext['txt']}'))"]),
                 ("member_content", [f"t = tarfile.open({path}, 'r:gz')",
                                     f"m = [n for n in t.getnames() if n.endswith('{d}/{first}')][0]",
                                     f"assert t.extractfile(m).read().decode() == {members[first]!r}"])]
        turns = [_turn(f"I need to pack the directory {d} into {a}.tar.gz.", "Use tar -czf and list it.",
                       [f"tar -czf {a}.tar.gz {d}", f"tar -tzf {a}.tar.gz"])]
        ins = f"Create the archive {a}.tar.gz in /app containing the directory {d}."
        files = {f"{d}/{f}": t for f, t in members.items()}
        return _spec(ins, files, tests, turns, f"{a}.tar.gz holds {d}.", [f"{a}.tar.gz"], template="archive/create")
    if kind == "extract":
        out = _dir(rng, "files")
        tests = [("dir_created", [f"assert os.path.isdir(A + '/{out}')"])]
        tests += [(f"extracted_{i}", [f"assert _read('{out}/{f}') == {t!r}"])
                  for i, (f, t) in enumerate(sorted(members.items()))]
        turns = [_turn(f"I need to unpack {a}.tar.gz into a new directory {out}.", "Make the dir, extract with -C.",
                       [f"mkdir {out}", f"tar -xzf {a}.tar.gz -C {out}", f"ls {out}"])]
        ins = f"Extract {a}.tar.gz into the new directory {out} in /app."
        return _spec(ins, {f"{a}.tar.gz": _tgz(members)}, tests, turns, f"{out} holds the files.", [out],
                     template="archive/extract")
    text = _text(rng, rng.randint(4, 8))
    f = f"{a}.{v.ext['txt']}"
    tests = [("gz_exists", [f"assert os.path.isfile(A + '/{f}.gz')"]),
             ("gz_content", [f"assert gzip.open(A + '/{f}.gz').read().decode() == {text!r}"]),
             ("original_kept", [f"assert os.path.isfile(A + '/{f}.gz')", f"assert _read({f!r}) == {text!r}"])]
    turns = [_turn(f"I need to gzip {f} and keep the original.", "Use gzip -k.", [f"gzip -k {f}", "ls"])]
    ins = f"Compress {f} in /app with gzip and keep the original file."
    return _spec(ins, {f: text}, tests, turns, f"{f}.gz exists and {f} is kept.", [f"{f}.gz"],
                 template="archive/gzip")


def fam_csvjson(rng):
    v = vocab_of(rng)
    kind = rng.choice(["filter", "sum", "jsonmax", "jsonlist"])
    out, = _names(rng, 1, "txt")
    num = rng.choice(v.columns)
    people = rng.sample(v.people, rng.randint(5, 9))
    vals = rng.sample(v.values, len(people))
    rows = [dict(name=p, **{num: x}, city=rng.choice(v.cities)) for p, x in zip(people, vals)]
    if kind in ("filter", "sum"):
        csv, = _names(rng, 1, "csv")
        cols = ["name"] + rng.sample([num, "city"], 2)
        files = {csv: ",".join(cols) + "\n" + "".join(",".join(str(r[c]) for c in cols) + "\n" for r in rows)}
        find = f"awk -F, -v c={num} 'NR==1{{for(i=1;i<=NF;i++)if($i==c)k=i;next}} "  # the column by its name
        if kind == "filter":
            n = sorted(vals)[rng.randint(1, len(vals) - 2)]
            want = [r["name"] for r in rows if r[num] > n]
            tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                     ("no_header", [f"assert _lines({out!r}) and 'name' not in _lines({out!r})"]),
                     ("right_names", [f"assert set(_lines({out!r})) == set({sorted(set(want))!r})"]),
                     ("file_order", [f"assert _lines({out!r}) == {want!r}"])]
            cmd = find + f"$k>{n}{{print $1}}' {csv} > {out}"
            ins = f"Write the names in {csv} whose {num} is greater than {n} to {out}, one per line."
            done = f"{out} lists the matching names."
        else:
            tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                     ("output_number", [f"assert _read({out!r}).strip().isdigit()"]),
                     ("sum_correct", [f"assert int(_read({out!r}).strip()) == {sum(vals)}"])]
            cmd = find + f"{{s+=$k}} END{{print s}}' {csv} > {out}"
            ins = f"Write the sum of the {num} column of {csv} to {out}."
            done = f"{out} holds the sum {sum(vals)}."
        act = _turn(f"I need the {num} column of {csv}; awk finds it by its name in the header.",
                    f"Use awk on the {num} column.", [cmd, f"cat {out}"])
        return _spec(ins, files, tests, [act], done, [out], template=f"csvjson/{kind}")
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
    return _spec(ins, files, tests, turns, done, [out], template=f"csvjson/{kind}")


def fam_find(rng):
    v = vocab_of(rng)
    kind = rng.choice(["grep", "name", "largest"])
    d = _dir(rng, "data")
    subs = _names(rng, 3, "")
    paths = [f"{d}/{rng.choice(subs)}/{f}" for f in _names(rng, rng.randint(4, 6), "txt")]
    files = {p: _text(rng, rng.randint(2, 5)) for p in paths}
    target = rng.choice(paths)
    if kind == "grep":
        out, = _names(rng, 1, "txt")
        w = f"{rng.choice(v.words).upper()}{v.n3(rng)}"
        files[target] += f"{rng.choice(v.words)} {w}\n"
        tests = [("output_exists", [f"assert os.path.isfile(A + '/{out}')"]),
                 ("has_word", [f"assert {w!r} in _read({out!r})"]),
                 ("same_content", [f"assert _read({out!r}) == {files[target]!r}"]),
                 ("source_kept", [f"assert os.path.isfile(A + '/{out}')",
                                  f"assert _read({target!r}) == {files[target]!r}"])]
        turns = [_turn(f"I must copy the file under {d} that has {w}.", f"grep -rl {w} names it; cp takes it.",
                       [f"cp $(grep -rl {w} {d}) {out}", f"cat {out}"])]
        ins = f"One file under {d} contains the word {w}. Copy that file to {out} in /app."
        return _spec(ins, files, tests, turns, f"{out} is a copy of {target}.", [out], template="find/grep")
    base = target.rsplit("/", 1)[1]
    if kind == "name":
        tests = [("file_in_app", [f"assert os.path.isfile(A + '/{base}')"]),
                 ("same_content", [f"assert _read({base!r}) == {files[target]!r}"]),
                 ("moved_not_copied", [f"assert os.path.isfile(A + '/{base}')",
                                       f"assert not os.path.exists(A + '/{target}')"])]
        turns = [_turn(f"I must move {base} from under {d} to /app.", "find -name gives its path to mv.",
                       [f"mv $(find {d} -name {base}) .", "ls"])]
        ins = f"Find the file named {base} under {d} and move it to /app."
        return _spec(ins, files, tests, turns, f"{base} is now in /app.", [base], template="find/name")
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
    turns = [_turn(f"I must move the largest file in {d} to {out}.", "ls -S lists it first; mv takes it.",
                   [f"mv {d}/$(ls -S {d} | head -1) {out}", "ls"])]
    ins = f"Move the largest file in {d} to {out} in /app."
    return _spec(ins, flat, tests, turns, f"{out} is the largest file from {d}.", [out], template="find/largest")


FAMILIES = {"files": fam_files, "text": fam_text, "perms": fam_perms, "archive": fam_archive,
            "csvjson": fam_csvjson, "find": fam_find}
# the deepest chain rst_extend builds on a family's outputs where it is bounded: the files family's output is a
# directory, which no op of RST_OPS takes; the archive's is a directory or a .gz file (backup and readonly only)
RST_MAX_DEPTH = {"files": 0, "archive": 2}


def rst_families(depth) -> tuple:
    """The families whose tasks rst_extend can extend by `depth` steps."""
    return tuple(f for f in FAMILIES if RST_MAX_DEPTH.get(f, depth) >= depth)


# --- RST: recursive task synthesis (extend the executable path, then rewrite the instruction) -------------------
def _op_backup(rng, o, fam):
    d = _dir(rng, "backup")
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
    any one step fails a test: weak_verifier). Returns a new spec (its template: the seed's + "+<op>" per step
    taken; fewer than `rounds` when the outputs run out of ops: rst_depth says how many); the seed spec is not
    changed."""
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
        spec["template"] = f"{spec['template']}+{name}"
        spec["tests"] += [(re.sub(r"\W", "_", n), lines) for n, lines in tests]  # test names: identifiers
        spec["turns"].append(_turn(f"Next I {phrase}.", f"Run {cmds[0].split()[0]}.", cmds))
        spec["outputs"] += outputs
        spec["done"] = f"{spec['done']} I also did: {phrase}."
    return spec


def rst_depth(spec) -> int:
    """The RST steps a spec carries (its template's "+<op>" parts)."""
    return spec["template"].count("+")


EXPERT_TEXTS = ("full", "terse", "restate")  # expert_replies' free text (train_t1 --expert-text)
TERSE = dict(analysis="Working on the task.", plan="Run the commands.", done="The task is done.")


def expert_replies(spec, text="full"):
    """Terminus-2 replies of the expert: the work turns, then task_complete twice (confirmation).

    text "full": each turn's analysis / plan restate the task's names and values (a teacher's prose); "terse": the
    same fixed words on every task (TERSE), so that the commands are the only task-specific tokens an SFT model
    learns to write (this project's choice, paper silent: its SFT transcripts are a teacher model's; measured:
    at T = 1 the tiny model's free text carries 92% of the policy gradient's variance and no signal, results/LOG.md);
    "restate": "full" with the first analysis opening on the instruction word for word ("The task: ..."), so that
    each name, value and verb a command needs was last written a few tokens back by the agent itself (the copy a
    tiny model can do; held-out failures were verbs and fields the "full" text never restates, results/LOG.md)."""
    if text not in EXPERT_TEXTS:
        raise ValueError(f"expert_replies: text must be one of {EXPERT_TEXTS}, got {text!r}")
    terse = text == "terse"
    replies = [dict(analysis=TERSE["analysis"] if terse else t["analysis"], plan=TERSE["plan"] if terse else t["plan"],
                    commands=[dict(keystrokes=c + "\n", duration=0.1) for c in t["cmds"]], task_complete=False)
               for t in spec["turns"]]
    if text == "restate":
        replies[0]["analysis"] = f"The task: {spec['instruction']} {replies[0]['analysis']}"
    replies.append(dict(analysis=TERSE["done"] if terse else spec["done"], plan="The task is complete.", commands=[],
                        task_complete=True))
    replies.append(dict(analysis="I checked the result.", plan="Confirm completion.", commands=[], task_complete=True))
    return replies
