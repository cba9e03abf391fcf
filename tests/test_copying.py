"""Tests for tasks/copying.py: random name-shaped strings for the base phase's copy data, and data.copy_samples
mixing them in."""
import collections
import json
import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import data  # noqa: E402
import model as M  # noqa: E402
from tasks import copying, families, splits  # noqa: E402

STEM = r"[a-z]{2,9}(?:[-_]?\d{1,3}|[-_][a-z]{2,7})?"
SHAPE = re.compile(rf"\d{{1,6}}|(?:{STEM}/)?{STEM}(?:\.[a-z]{{2,4}}|/)?")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """-> (texts, items, names): the corpus of 12 training tasks (not sandbox-validated), its copy items and the
    names of those tasks and of 6 unseen-vocabulary ones."""
    out = tmp_path_factory.mktemp("tasks")
    train, _ = data.generate_tasks(str(out / "train"), 12, 0, seed=3, validate_tasks=False)
    _, unseen = data.generate_tasks(str(out / "unseen"), 0, 6, seed=3, validate_tasks=False, vocab="unseen")
    texts = data.corpus(train)
    names = {"train": {n for d in train for n in splits.names_of(d)},
             "unseen": {n for d in unseen for n in splits.names_of(d)}}
    return texts, data.copy_items(texts), names


def test_random_names_are_deterministic_name_shaped_and_varied():
    """One seed draws the same names, another seed others; every name has a name's shape (a number, or a stem of
    letters with digits or a word after a separator, an extension or a trailing '/', a dir/ prefix), is shorter than
    the copy items' cap and distinct; every part of the shape occurs."""
    names = copying.random_names(3000, 7)
    assert names == copying.random_names(3000, 7) and len(set(names)) == 3000
    assert len(set(names) & set(copying.random_names(3000, 8))) < 300  # short numbers may repeat across seeds
    assert copying.MAX_CHARS == data.COPY_ITEM_CHARS
    bad = [n for n in names if not SHAPE.fullmatch(n) or len(n) >= data.COPY_ITEM_CHARS]
    assert not bad, bad[:10]
    share = collections.Counter()
    for n in names:
        share["number"] += n.isdigit()
        share["ext"] += bool(re.search(r"\.[a-z]{2,4}$", n))
        share["dir/"] += "/" in n.rstrip("/")
        share["dir"] += n.endswith("/")
        share["-"] += "-" in n
        share["_"] += "_" in n
        share["1 digit"] += bool(re.search(r"(?<![0-9])[0-9](?![0-9])", n))
        share["3 digits"] += bool(re.search(r"(?<![0-9])[0-9]{3}(?![0-9])", n))
        share["word"] += bool(re.fullmatch(r"[a-z]+", n))
    assert all(share[k] > 30 for k in ("number", "ext", "dir/", "dir", "-", "_", "1 digit", "3 digits", "word")), share
    assert 0.35 < share["ext"] / len(names) < 0.6, share  # half of the stems that are not numbers
    with pytest.raises(ValueError, match="random_names: n must be"):
        copying.random_names(-1, 0)


def test_random_names_avoid_the_corpus_and_every_vocabulary_word(corpus, monkeypatch):
    """No random name is a corpus piece, a task name of either vocabulary or a name of `avoid`; no letter run of one
    is a word of families.UNSEEN (or TRAIN): the unseen-names split's words are never copy-trained. The filter does
    work: without RESERVED the same draws hold vocabulary words, and without avoid they hold the avoided names."""
    texts, items, names = corpus
    drawn = copying.random_names(copying.N_NAMES, 0, avoid=items)
    assert not set(drawn) & set(items) and not set(drawn) & (names["train"] | names["unseen"])
    unseen = set(families.UNSEEN.words + families.UNSEEN.people + families.UNSEEN.cities + families.UNSEEN.colors
                 + families.UNSEEN.columns)
    assert not {r for n in drawn for r in re.findall("[a-z]+", n)} & unseen
    assert copying.reserved("quasar7") and copying.reserved("x/nimbus_204.dat") and not copying.reserved("quasarx7")
    monkeypatch.setattr(copying, "RESERVED", frozenset())
    loose = copying.random_names(copying.N_NAMES, 0)
    monkeypatch.undo()
    assert any(copying.reserved(n) for n in loose)
    hit = set(loose) & set(items)
    assert hit  # short numbers and letter runs of the corpus come up unfiltered
    assert not hit & set(copying.random_names(copying.N_NAMES, 0, avoid=hit))
    probe = copying.random_names(512, "probe/0", avoid=set(items) | set(drawn))  # the gate's fresh names
    assert len(probe) == 512 and not set(probe) & (set(items) | set(drawn))
    with pytest.raises(ValueError, match="drew only"):
        copying.random_names(100, 0, max_chars=2)


def test_copy_samples_mix_random_names_at_the_share_and_round_trip(corpus):
    """share: the fraction of copied items drawn from `names` (else from items); share 0 draws what copy_samples
    always drew (the same tokens as without names); every sample decodes back to its list, random names included
    (byte-level BPE: characters the corpus never joined)."""
    texts, items, _ = corpus
    tok = M.train_tokenizer(texts, vocab_size=600)
    names = copying.random_names(2000, 0, avoid=items)
    plain = data.copy_samples(tok, items, 50, seed=2)
    assert [s["tokens"] for s in plain] == [s["tokens"] for s in data.copy_samples(tok, items, 50, 2, names, 0.0)]
    for share in (0.25, 0.5, 1.0):
        samples = data.copy_samples(tok, items, 400, seed=2, names=names, share=share)
        assert [s["tokens"] for s in samples[:20]] == [s["tokens"] for s in data.copy_samples(
            tok, items, 20, seed=2, names=names, share=share)]
        copied = []
        for s in samples:
            toks, mask = s["tokens"], s["loss_mask"]
            assert len(toks) == len(mask) == len(s["rollout_logprobs"])
            listed = tok.decode(toks[:len(toks) - sum(mask)]).split("list: ")[1].split("<|im_end|>")[0]
            assert tok.decode([t for t, m in zip(toks, mask) if m]) == f"copy: {listed}<|im_end|>"
            assert tok.decode(toks[s["copy_from"]:-1]) == " " + listed
            assert 3 <= len(listed.split()) <= 8 and set(listed.split()) <= set(items) | set(names)
            copied += listed.split()
        got = sum(x in set(names) for x in copied) / len(copied)  # ~2,200 items: binomial sd <= .011
        assert abs(got - share) < 0.05, (share, got)
    for bad in (dict(share=0.5), dict(names=names, share=1.5), dict(names=names, share=-0.1)):
        with pytest.raises(ValueError, match="copy_samples: need items"):
            data.copy_samples(tok, items, 4, 0, **bad)


def test_made_up_vocabularies_name_a_share_of_a_pool(tmp_path, corpus):
    """copying.random_vocab: deterministic in its seed, every word, colour, person, city, column, extension and suffix
    made up (no RESERVED letter run: no word of TRAIN or UNSEEN); generate_tasks' random_share draws about that share
    of the slots from one each (names no training-vocabulary or unseen-vocabulary task has), the other slots exactly
    as a pool without it (share 0 is the pool of before, its cache key too)."""
    v, again = copying.random_vocab("s"), copying.random_vocab("s")
    assert (v.words, v.people, v.ext, v.suffix) == (again.words, again.people, again.ext, again.suffix)
    assert not set(v.words) & set(copying.random_vocab("t").words)
    made_up = [*v.words, *v.colors, *v.people, *v.cities, *v.columns, v.ext["txt"], v.ext["log"], v.ext["key"],
               *(x.strip("-_") for x in v.suffix.values())]
    assert len(set(made_up)) == len(made_up) and not any(copying.reserved(w) for w in made_up)
    unseen_names = corpus[2]["unseen"]
    mixed, _ = data.generate_tasks(str(tmp_path / "mixed"), 60, 0, seed=3, validate_tasks=False, random_share=0.5)
    plain, _ = data.generate_tasks(str(tmp_path / "plain"), 60, 0, seed=3, validate_tasks=False)
    train_words = set(families.TRAIN.words)
    made = [d for d in mixed if not any(w in train_words for n in splits.names_of(d) for w in re.findall("[a-z]+", n))]
    assert 15 <= len(made) <= 45, len(made)
    for d, p in zip(mixed, plain):
        same = open(os.path.join(d, "instruction.md")).read() == open(os.path.join(p, "instruction.md")).read()
        assert same == (d not in made), d
    made_names = {n for d in made for n in splits.names_of(d)}
    assert not made_names & (unseen_names | corpus[2]["train"])
    with pytest.raises(ValueError, match="random_share"):
        data.generate_tasks(str(tmp_path / "bad"), 1, 0, seed=3, validate_tasks=False, random_share=1.5)


def test_made_up_vocabulary_tasks_pass_the_sandbox_audit(tmp_path):
    """A task of each family drawn from a made-up vocabulary passes the full audit (oracle in the sandbox, the
    scripted expert's trajectory, RST's quality): none dropped."""
    train, _ = data.generate_tasks(str(tmp_path / "p"), 6, 0, seed=5, random_share=1.0)
    summary = json.load(open(tmp_path / "p" / "summary.json"))
    assert len(train) == 6 and not summary["dropped"], summary["dropped"]
