"""Copy data past the training corpus: random strings in the shapes names take, for the base phase's copy samples.

The base phase (train_t1.base_phase) teaches the embedded model to copy with data.copy_samples. Drawn from the SFT
corpus's pieces alone, what it teaches is copying names whose pieces the tokenizer merged and the model has seen, and
the copy gate read on fresh samples of the same pieces cannot tell. random_names draws strings of the shapes a task's
names take (letters, a '-' / '_' separator, 1-3 digits, a '.' extension, a dir/ prefix; plain numbers) from random
letters and digits, so that copying them is copying characters: data.copy_samples(..., names=, share=) mixes them
into the copied items, and a probe of names never trained on (avoid= the training ones) reads the copy gate on
strings no training text holds.

No letter run of a name (a maximal run of a-z) is a word of any families vocabulary (TRAIN's or UNSEEN's words,
colours, people, cities, columns, extensions, suffixes): the unseen-names test split's words never appear in copy
training, and none of its pools is drawn from: the shapes ('-' / '_', 1-3 digits, extensions) are generic ones,
filled with random characters.

random_vocab(seed) is a made-up vocabulary of the same letters and shapes, one per task: data.generate_tasks'
random_share draws that share of a pool's slots from one (an SFT pool's, --sft-names-share), so that the names an
agent is taught to copy are mostly names it sees once, as the unseen-names test split's are.

Departure from the paper: the paper has no base phase (pretrained Qwen3.5 copies strings it never saw); the random
names, the made-up vocabularies and their shares are this project's, like the base phase (train_t1's departures).
"""
import random
import re
import string

from tasks import families

NAME_SHARE = 0.5  # `bench copy`'s share of copied items that are random names (this project's): half the corpus's
# own pieces, half character-level copying; train_t1's --base-name-share is 0 (its departure 8 says why)
N_NAMES = 20_000  # random names the base phase draws from (this project's): 1,000 steps of 16 samples copy ~44,000
# items at NAME_SHARE, so each name comes back ~2 times and copying cannot lean on having seen a name
MAX_CHARS = 24  # a name is shorter than this (data.COPY_ITEM_CHARS: the corpus pieces' cap)
LETTERS, DIGITS, VOWELS = string.ascii_lowercase, string.digits, "aeiou"
CONSONANTS = "".join(c for c in LETTERS if c not in VOWELS)
RESERVED = frozenset(w.strip("-_.").lower() for v in families.VOCABS.values()
                     for w in (*v.words, *v.colors, *v.people, *v.cities, *v.columns, *v.ext.values(),
                               *v.suffix.values()))


def _letters(rng, lo: int, hi: int) -> str:
    """lo..hi random lowercase letters: uniform ones (kqvz) or, half the time, syllables of a consonant, a vowel and
    (a third of them) a consonant (tolmar), the shape of a word the tokenizer splits into familiar pieces."""
    n = rng.randint(lo, hi)
    if rng.random() < 0.5:
        return "".join(rng.choice(LETTERS) for _ in range(n))
    out = ""
    while len(out) < n:
        out += rng.choice(CONSONANTS) + rng.choice(VOWELS) + (rng.choice(CONSONANTS) if rng.random() < 1 / 3 else "")
    return out[:n]


def _digits(rng, lo: int, hi: int) -> str:
    """lo..hi random digits (a leading zero allowed: names such as run007 have them)."""
    return "".join(rng.choice(DIGITS) for _ in range(rng.randint(lo, hi)))


def _stem(rng) -> str:
    """A file or dir stem: letters, then (mostly) a separator and 1-3 digits or more letters: kqv, tolm_7,
    bexa-204, wirp-dolo."""
    out = _letters(rng, 2, 9)
    tail = rng.random()
    if tail < 0.7:
        out += rng.choice(("", "-", "_")) + _digits(rng, 1, 3)
    elif tail < 0.85:
        out += rng.choice(("-", "_")) + _letters(rng, 2, 7)
    return out


def random_name(rng) -> str:
    """One name-shaped string: a plain number (1-6 digits, a tenth of the draws), else a stem with (half the time) an
    extension of 2-4 letters, a dir/ prefix (a fifth) or, without an extension, a trailing '/' (a tenth)."""
    if rng.random() < 0.1:
        return _digits(rng, 1, 6)
    name = _stem(rng)
    if rng.random() < 0.5:
        name += "." + _letters(rng, 2, 4)
    elif rng.random() < 0.1:
        name += "/"
    if rng.random() < 0.2:
        name = _stem(rng) + "/" + name
    return name


def reserved(name: str) -> bool:
    """Whether a letter run of the name is a families vocabulary's word (RESERVED)."""
    return any(run in RESERVED for run in re.findall("[a-z]+", name))


def random_names(n: int, seed, avoid=(), max_chars: int = MAX_CHARS) -> list:
    """n distinct random names (random_name, deterministic in seed), each shorter than max_chars, none in `avoid`
    (the corpus's pieces: data.copy_items; for a probe, the training names too) and none with a RESERVED word."""
    if n < 0:
        raise ValueError(f"random_names: n must be >= 0, got {n}")
    rng, avoid, out, seen = random.Random(f"names/{seed}"), set(avoid), [], set()
    for _ in range(50 * n + 100):
        if len(out) == n:
            break
        name = random_name(rng)
        if len(name) < max_chars and name not in avoid and name not in seen and not reserved(name):
            seen.add(name)
            out.append(name)
    if len(out) < n:
        raise ValueError(f"random_names: drew only {len(out)} of {n} new names (avoid holds {len(avoid)})")
    return out


def random_vocab(seed) -> families.Vocab:
    """A made-up vocabulary (deterministic in seed) in TRAIN's layout: 30 words, 10 colours, 23 people, 10 cities and
    3 column names of random letters or syllables (_letters; distinct, none with a RESERVED letter run), stems of a
    word, '' / '-' / '_' and 1-3 digits, made-up extensions for .txt / .log / .key and directory suffixes ('-' or '_'
    and a made-up word). Kept from TRAIN: .sh / .csv / .json (the tools they name), the numbers, values and modes
    (the unseen split's differ; here only the names are new)."""
    rng, taken = random.Random(f"vocab/{seed}"), set()

    def fresh(k, lo, hi):
        out = []
        while len(out) < k:
            w = _letters(rng, lo, hi)
            if w not in taken and not reserved(w):
                taken.add(w)
                out.append(w)
        return tuple(out)
    words, colors, people, cities, columns = fresh(30, 4, 8), fresh(10, 3, 6), fresh(23, 2, 5), fresh(10, 4, 7), \
        fresh(3, 3, 7)
    t, kept = families.TRAIN, ("sh", "csv", "json")  # TRAIN's roles; the extensions that name a tool stay
    made = [e for e in t.ext if e not in kept]
    ext = {**dict(zip(made, fresh(len(made), 2, 4))), **{e: t.ext[e] for e in kept}}
    suffix = {role: rng.choice("-_") + w for role, w in zip(t.suffix, fresh(len(t.suffix), 3, 7))}

    def stem(r):  # the task's rng draws the stem from this vocabulary's words: tolmar_7, kqvee-204, bexa31
        digits = r.randint(0, 9) if r.random() < 0.5 else r.randint(10, 999)
        return f"{r.choice(words)}{r.choice(('', '-', '_'))}{digits}"
    return families.Vocab(f"random/{seed}", words, colors, people, cities, columns, t.values, t.key_modes,
                          t.dir_modes, ext, suffix, stem, t.n3, t.n4)
