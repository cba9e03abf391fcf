"""The evaluation splits (data.eval_splits, tasks/splits.py): the out-of-template split shares no template with
training, the unseen-names split no name, and the training vocabulary's draws are what the generator always drew."""
import hashlib
import json
import os
import random
import re
import shutil

import pytest

import data
import rollout
from sandbox import task_io
from tasks import families, pool_cache, splits

# sha256 of a small pool's specs (seed 5, train split, 48 slots, RST rounds 0 / 1 / 2) drawn by the generator before
# vocabularies and templates (git show 5426f42:tasks/families.py): the "train" vocabulary must draw the same bytes
OLD_DIGEST = "5bed24c9d4e31798a7420fcaba593f76007daa5fb6324dab5b5cb964beda87fe"
SANDBOX = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="the sandbox needs root and bwrap")


def _digest(make_rng):
    h = hashlib.sha256()
    for rounds in (0, 1, 2):
        for slot in range(48):
            fam = list(families.FAMILIES)[slot % 6]
            rng = make_rng(f"5/train/{slot}/0")
            s = families.FAMILIES[fam](rng)
            if rounds:
                s = families.rst_extend(s, fam, rng, rounds)
            files = {k: v.hex() if isinstance(v, bytes) else v for k, v in s["files"].items()}
            h.update(json.dumps([s["instruction"], files, s["tests"], s["turns"], s["done"], s["outputs"]]).encode())
    return h.hexdigest()


def test_the_train_vocabulary_draws_what_the_generator_always_drew():
    assert _digest(lambda k: families.VocabRandom(k, "train")) == OLD_DIGEST
    assert _digest(random.Random) == OLD_DIGEST  # a plain Random draws from the train vocabulary
    assert _digest(lambda k: families.VocabRandom(k, "unseen")) != OLD_DIGEST
    with pytest.raises(ValueError, match="vocab"):
        families.VocabRandom(1, "other")


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """A depth <= 1 training pool (rst_rounds 1, as --full) and 60 tasks of each test split, drawn unaudited."""
    root = tmp_path_factory.mktemp("splits")
    train, _ = data.generate_tasks(root / "train", 600, 0, 7, validate_tasks=False, rst_rounds=1)
    avoid = data.instructions(train)

    def split(name, **kw):
        return data.generate_tasks(root / name, 0, 60, 7, validate_tasks=False, heldout_split=name, avoid=avoid,
                                   **dict(dict(rst_rounds=1), **kw))[1]
    return train, split("test"), split("test_deep", rst_depths=data.DEEP_DEPTHS), split("test_names", vocab="unseen")


def test_the_out_of_template_split_shares_no_template_and_the_in_template_split_all(pools):
    train, test, deep, _ = pools
    assert max(families.rst_depth(dict(template=splits.template_of(d))) for d in train) == 1
    assert data.overlap(train, test)["templates_shared"] == 1.0
    o = data.overlap(train, deep)
    assert o["templates_shared"] == 0.0 and o["instructions_shared"] == 0
    depths = []
    for d in deep:  # each task really has its depth: that many "Then" steps, expert turns and template ops
        template, ins = splits.template_of(d), open(os.path.join(d, "instruction.md")).read()
        n = template.count("+")
        with open(os.path.join(d, "solution", "terminus2.json")) as f:
            turns = [r for r in json.load(f) if not r["task_complete"]]
        assert ins.count(" Then ") == n == len(turns) - 1, (d, template)
        depths.append(n)
    assert set(depths) == set(data.DEEP_DEPTHS)
    assert len({splits.template_of(d).split("/")[0] for d in deep}) == 5  # every family RST can extend


def _skeleton(ins, names):
    """The instruction with its names and values masked: what is left is the template's wording."""
    vocab = {w for v in families.VOCABS.values() for pool in (v.words, v.colors, v.people, v.cities, v.columns)
             for w in pool}
    out = []
    for tok in ins.split():
        bare = tok.rstrip(".,")
        out.append("X" if bare in names or bare in vocab or re.search(r"\d", bare) else tok)
    return " ".join(out)


def test_the_unseen_names_split_shares_no_name_and_keeps_the_templates(pools):
    train, _, _, named = pools
    o = data.overlap(train, named)
    assert o["names_seen"] == 0.0 and o["templates_shared"] == 1.0
    train_words = {w for pool in (families.TRAIN.words, families.TRAIN.people, families.TRAIN.cities,
                                  families.TRAIN.colors, families.TRAIN.columns) for w in pool}
    assert not train_words & {w for pool in (families.UNSEEN.words, families.UNSEEN.people, families.UNSEEN.cities,
                                             families.UNSEEN.colors, families.UNSEEN.columns) for w in pool}
    seen = {_skeleton(open(os.path.join(d, "instruction.md")).read(), set(splits.names_of(d))) for d in train}
    for d in named:
        names = splits.names_of(d)
        for n in names:  # word, '-' / '_' / nothing, 1 or 3 digits (the training shape: word + 2 digits)
            stem = re.match(r"([a-z]+)([-_]?)(\d+)", n)
            assert stem and stem.group(1) in families.UNSEEN.words and len(stem.group(3)) in (1, 3), n
        assert _skeleton(open(os.path.join(d, "instruction.md")).read(), set(names)) in seen, d


def test_a_depth_that_cannot_be_reached_is_a_loud_error(monkeypatch):
    monkeypatch.setattr(families, "RST_MAX_DEPTH", {})  # the files family offered a depth its output cannot take
    with pytest.raises(RuntimeError, match="files task of RST depth 3 for test_deep slot 0"):
        data._draw("test_deep", 0, 1, set(), rst_depths=(3,))


def test_the_cache_key_has_the_depths_and_the_vocabulary(monkeypatch):
    seen = []
    monkeypatch.setattr(pool_cache, "cached", lambda out_dir, args, generate: seen.append(args) or ([], []))
    for kw in ({}, dict(rst_depths=(3, 2)), dict(rst_depths=[2, 3, 2]), dict(vocab="unseen")):
        data.generate_tasks("unused", 6, 3, 5, **kw)
    keys = [pool_cache.pool_key(a) for a in seen]
    assert keys[1] == keys[2] and len(set(keys)) == 3
    with pytest.raises(ValueError, match="vocab"):
        data.generate_tasks("unused", 6, 3, 5, vocab="other")
    with pytest.raises(ValueError, match="rst_depths"):
        data.generate_tasks("unused", 6, 3, 5, rst_depths=(0,))
    with pytest.raises(ValueError, match="deeper than rst_rounds 2"):  # training as deep: no out-of-template split
        data.eval_splits("unused", 5, 0, 0, 4, 0, rst_rounds=2)


def test_a_generated_task_without_a_template_is_a_loud_error(tmp_path):
    d = data.write_task(str(tmp_path / "t"), families.fam_text(random.Random(3)), "text", "test", 3)
    assert splits.template_of(d).startswith("text/") and splits.names_of(d)
    toml = os.path.join(d, "task.toml")
    with open(toml) as f:
        text = f.read()
    with open(toml, "w") as f:
        f.write(re.sub(r"^template = .*\n", "", text, flags=re.M))
    with pytest.raises(ValueError, match=re.escape(d) + ".*template"):
        splits.template_of(d)
    with open(toml, "w") as f:  # a task this project did not write: no template, its names from its /app tree
        f.write(text.replace(splits.AUTHOR, "someone else"))
    assert splits.template_of(d) is None and set(splits.names_of(d)) == set(os.listdir(
        os.path.join(d, "environment", "app")))


@SANDBOX
def test_each_split_is_drawn_apart_and_audited_in_the_sandbox(tmp_path):
    """eval_splits: every split sandbox-audited (its oracle resolves, nop fails: here once more by hand), named in
    task.toml, none sharing an instruction with `avoid` or another split."""
    train, _ = data.generate_tasks(tmp_path / "train", 12, 0, 3, validate_tasks=False, rst_rounds=1)
    out = data.eval_splits(tmp_path / "eval", 3, 1, 1, 2, 2, avoid=train, rst_rounds=1, scripted=False)
    assert {k: len(v) for k, v in out.items()} == {"val": 1, "test": 1, "test_deep": 2, "test_names": 2}
    ins = [data.instructions(v) for v in [train] + list(out.values())]
    assert sum(map(len, ins)) == len(set().union(*ins))
    for split, dirs in out.items():
        for d in dirs:
            meta = task_io.load_task(d).config["metadata"]
            assert meta["split"] == split and meta["audit"] in ("accepted", "borderline")
    for d in (out["test_deep"][0], out["test_names"][0]):
        assert rollout.run_trial(d, "oracle")["resolved"]
        nop = rollout.run_trial(d, "nop")
        assert nop["passed"] < nop["total"]
