"""TITO: train on the exact sampled token ids (paper section "TITO"): trajectory assembly, boundary repair, audit.

Token fidelity T^t_j = T^r_j: the trainer conditions on the token ids the sampler actually produced. Encoding happens
once per turn with a pinned, append-only chat template; where a harness still forces a mismatch, every turn boundary
is repaired by the first of four escalating cases that applies (strict, normalized, retokenized, split: "boundary
classification" below); sampled tokens get m = 1, tool output and template glue m = 0; an auditor relocates every
completion and reports token drift in the loss region (`audit`; paper: "0.0000% in the 1,402-sample production
audit"). The harness's re-tokenized copy of a completion never enters the training stream.

The loss-mask convention (stated once, used everywhere: critic.py, train_t1.py, r3.py):
    m[j] = 1  iff  token j of the sample was sampled by the policy (it has a rollout logprob);
    m[j] = 0  for prompt, tool output and template glue.
    Per-token tensors are indexed by j: logprobs[j] = log pi(tokens[j] | tokens[:j]). The routing row
    R[j] is the router's choice when token j is the *input*, so it shapes the prediction of token j+1:
    a placeholder routing row is allowed only where m[j+1] = 0 (paper, R3).

    python tito.py audit SAMPLES_PATH [--json]   # cases, loss-region drift (4 decimals), relocation failures;
                                                 # exit 1 when a loss-region token drifted
    python -m experiments.bench tito --quick     # naive vs TITO through the token gateway (engine/gateway.py)

Departures from the paper:
  1. A split boundary yields one more sample (segment) carrying the trajectory's reward (the paper does not say how a
     split trajectory is trained); `assemble` refuses a split, `assemble_segments` returns every segment.
  2. normalized / retokenized need the tokenizer (`tok`); without it only strict is repaired. The native harness
     (rollout.py) is token-first: every boundary there is strict (the paper's future-work fix for its 2.6%).
  3. Each sample carries its trial's turn ids (delta-encoded, O(T)) so that the auditor can run on saved samples;
     the paper does not say where its auditor reads the records from.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path


def build_parser():
    """The command line (standard library only: `--help` answers before numpy loads)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("audit", formatter_class=fmt,
                       help="audit samples written by a run (a .jsonl file or a directory of them)",
                       description="Relocate every completion of saved samples, classify each turn boundary and "
                                   "report the token drift in the loss region; exit 1 when a loss-region token "
                                   "drifted.")
    a.add_argument("samples_path", help="a samples .jsonl file, or a directory searched for *.jsonl files")
    a.add_argument("--json", action="store_true", help="print the report as one JSON line")
    return p


if __name__ == "__main__":
    ARGV = build_parser().parse_args()  # --help and bad flags answer here, before numpy loads

import numpy as np  # noqa: E402

from chat_tokens import IM_END, PAD  # noqa: E402

CASES = ("strict", "normalized", "retokenized", "split")


# --- boundary classification -------------------------------------------------------------------------
# The four cases of a turn boundary (P_i = prompt ids of turn i, O_i = its sampled ids, P_{i+1} = the
# next prompt as the harness built it; the first case that applies wins):
#     strict       P_{i+1} extends P_i + O_i token for token.
#     normalized   P_{i+1} extends P_i, and the harness's copy X of the completion (the ids of P_{i+1}
#                  after P_i up to the first end-of-turn id) equals O_i after boundary normalisation:
#                  drop trailing end-of-turn ids (<|im_end|>, <|endoftext|>, eos), then whitespace-only
#                  tokens at both ends. (Clients strip the reply; the template re-adds <|im_end|>.)
#     retokenized  P_{i+1} extends P_i and decode(X).strip() == decode(O_i minus end-of-turn).strip(),
#                  with different ids: the harness re-encoded the text of the history.
#     split        anything else (P_{i+1} rewrote earlier history: summarisation, truncation, an edited
#                  reply): a new segment starts at P_{i+1}.
# Repair (strict, normalized, retokenized): the training stream continues with O_i exactly as sampled
# (m = 1), then the glue G = P_{i+1}[h:] (h = end of X in P_{i+1}; the harness's end-of-turn id is skipped
# when O_i already ends with one), m = 0. So one sample per segment holds the sampled ids in the loss
# region and the harness's own ids everywhere else; X itself (the re-encoded copy) is dropped. The turn
# i+1 completion was sampled conditioned on X, the trainer conditions it on O_i: for normalized and
# retokenized boundaries this is a small off-policy shift in the *context* (same text, other ids) that the
# PPO ratio absorbs, never a wrong token in the loss region. Routing rows follow the stream: rows of
# P_s and of O_i from the record that first forwarded them, glue rows from the prefill of P_{i+1}
# (the sampler's own choice at that token), and the row of O_i's last token (which predicts glue, m = 0)
# from P_{i+1}'s prefill at h-1 (exact when strict, the nearest analogue otherwise).

def end_of_turn_ids(tok) -> set[int]:
    """Ids that close a turn: <|im_end|>, <|endoftext|> and the tokenizer's eos (those it has)."""
    ids = {tok.convert_tokens_to_ids(t) for t in (IM_END, PAD)}
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return {int(i) for i in ids if i is not None and i != tok.unk_token_id}


def _strip(ids: list[int], tok, eot: set[int]) -> list[int]:
    """Boundary normalisation: drop trailing end-of-turn ids, then whitespace-only tokens at both ends."""
    ids = list(ids)
    while ids and ids[-1] in eot:
        ids.pop()
    blank = lambda t: t not in eot and tok.decode([t]).strip() == ""  # noqa: E731
    a, b = 0, len(ids)
    while a < b and blank(ids[a]):
        a += 1
    while b > a and blank(ids[b - 1]):
        b -= 1
    return ids[a:b]


def classify_boundary(prompt: list[int], output: list[int], next_prompt: list[int], tok=None) -> tuple[str, int | None]:
    """Case of the boundary turn i -> i+1 and h, the index in next_prompt where the glue starts (None: split)."""
    n, m = len(prompt), len(output)
    if next_prompt[:n + m] == prompt + output:
        return "strict", n + m  # the next prompt extends prompt + output token for token
    if next_prompt[:n] != prompt or tok is None:
        return "split", None  # earlier history rewritten (or no tokenizer to look closer)
    eot = end_of_turn_ids(tok)
    rest = next_prompt[n:]
    e = next((k for k, t in enumerate(rest) if t in eot), len(rest))  # the harness's copy X = rest[:e]
    x = rest[:e]
    h = n + e + (1 if e < len(rest) and output and output[-1] in eot else 0)  # skip its duplicate end-of-turn
    if _strip(x, tok, eot) == _strip(output, tok, eot):
        return "normalized", h
    body = [t for t in output if t not in eot]
    if tok.decode(x, skip_special_tokens=True).strip() == tok.decode(body, skip_special_tokens=True).strip():
        return "retokenized", h
    return "split", None


def _harness_drift(x: list[int], output: list[int]) -> int:
    """Sampled ids not found at their position in the copy x (mismatches + the ones x lacks); <= len(output)."""
    return sum(int(a != b) for a, b in zip(x, output)) + max(len(output) - len(x), 0)


# --- assembly ----------------------------------------------------------------------------------------
# Sample record (one per segment; one per trajectory unless a boundary split; `save_samples` /
# `load_samples` read back exactly):
#     task, tokens (T,), loss_mask (T,), rollout_logprobs (T,) (0 where m = 0),
#     routed_experts (T-1, L, k) int32 or None, reward, passed, total, reward_source, exit_reason,
#     turns, weight_version, cases {strict, normalized, retokenized, split} (boundaries inside the
#     segment, plus the split that opened it), segment, n_segments, spans [(start, end)] of each
#     completion, sampled [[ids]] (the engine's output ids), harness_drift_tokens (sampled ids the harness's
#     own copy got wrong: what naive retokenization would have trained on), and the auditor's reference:
#     turn_ids (every turn's prompt and output ids, `pack_turns`), boundaries [[case, h]] per boundary.
# The trajectory's reward goes on the last token of every segment.
#
# Policy (what aborts):
#   - R3 replay on (`replay=True`): a turn without its routing capture, or with a capture that does not cover
#     prompt + output - 1 rows, raises CaptureError naming the trial, the turn and the engine flag
#     (SGLang's --enable-return-routed-experts); the trainer lets it abort the step, never drops the trial.
#     Replay off: an incomplete capture only leaves routed_experts None.
#   - The auditor refuses a sample without its turn records or with boundaries inconsistent with them;
#     `python tito.py audit` exits 1 on any loss-region drift; train_t1.py aborts the step on one.

class _Segment:
    """The training stream of one segment, built turn by turn; rows[j] = (record, row) of token j's routing."""

    def __init__(self, records, first, split_opened):
        p = [int(t) for t in records[first]["prompt_ids"]]
        self.tokens, self.mask, self.logprobs = list(p), [0] * len(p), [0.0] * len(p)
        self.rows = [(first, j) for j in range(len(p))]
        self.spans, self.sampled, self.harness_drift, self.turns = [], [], 0, []
        self.cases = dict.fromkeys(CASES, 0)
        self.cases["split"] += int(split_opened)

    def add_output(self, rec, i, name):
        out, n = [int(t) for t in rec["output_ids"]], len(rec["prompt_ids"])
        lp = rec.get("output_logprobs")
        if lp is not None and len(lp) != len(out):
            raise ValueError(f"trial {name!r} turn {i}: {len(lp)} logprobs for {len(out)} sampled tokens")
        start = len(self.tokens)
        self.tokens += out
        self.mask += [1] * len(out)  # m = 1 exactly on sampled tokens
        self.logprobs += [float(x) for x in lp] if lp is not None else [0.0] * len(out)
        self.rows += [(i, n + t) for t in range(len(out))]
        self.spans.append((start, start + len(out)))
        self.sampled.append(out)
        self.turns.append(i)

    def add_glue(self, next_prompt, i_next, h):
        glue = [int(t) for t in next_prompt[h:]]
        if self.rows:
            self.rows[-1] = (i_next, h - 1)  # last token before the glue: from the next turn's prefill
        self.tokens += glue
        self.mask += [0] * len(glue)
        self.logprobs += [0.0] * len(glue)
        self.rows += [(i_next, h + t) for t in range(len(glue))]


class CaptureError(ValueError):
    """R3 replay is on and a turn of a trial has no usable routing capture: the step aborts (never dropped)."""


ENGINE_CAPTURE_HINT = ("the engine returned no routed experts: start SGLang with --enable-return-routed-experts "
                       "(cluster.launch.sglang_command passes it); the embedded engine (engine.server.EngineServer) "
                       "captures when the request sets return_routed_experts, as engine.client.EngineClient always "
                       "does")


def _routing(seg: _Segment, records, name, replay: bool) -> np.ndarray | None:
    """Routing (T-1, L, k) of a segment, each row from the forward that computed it (see the docstring).

    replay: every turn must carry its capture, else CaptureError naming the trial, the turn and the engine flag.
    Not replay: the routing is kept when every turn has a well-shaped capture, else None (R3 off needs none).
    """
    shape = None
    for i, rec in enumerate(records):
        need = len(rec["prompt_ids"]) + len(rec["output_ids"]) - 1
        re = rec.get("routed_experts")
        re = None if re is None else np.asarray(re)
        if re is None or re.ndim != 3 or re.shape[0] != need or (shape is not None and re.shape[1:] != shape):
            if not replay:
                return None
            got = None if re is None else tuple(re.shape)
            want = (need,) + (tuple(shape) if shape is not None else ("L", "k"))
            hint = ENGINE_CAPTURE_HINT if re is None else "the capture does not cover prompt + output - 1 rows"
            raise CaptureError(f"trial {name!r} turn {i}: routed experts missing or wrongly shaped: expected {want}, "
                               f"got {got}; R3 replay never trains without the capture ({hint})")
        shape = shape or re.shape[1:]
    out = np.empty((len(seg.tokens) - 1,) + tuple(shape), dtype=np.int32)  # (T-1, L, k)
    for j, (i, r) in enumerate(seg.rows[:-1]):
        out[j] = np.asarray(records[i]["routed_experts"])[r]
    return out


def assemble_segments(trial: dict, tok=None, replay: bool = False) -> list[dict]:
    """Training samples of a trial from its per-turn records: one per segment (four-case repair).

    replay (R3 on): a turn without its routing capture raises CaptureError; off: routing is kept when complete."""
    records = trial.get("records") or []
    name = trial.get("task", "?")
    if not records:
        raise ValueError(f"trial {name!r}: no model turns recorded, nothing to train on")
    segs, splits, boundaries = [_Segment(records, 0, False)], [], []
    for i, rec in enumerate(records):
        segs[-1].add_output(rec, i, name)
        if i + 1 == len(records):
            break
        prompt, out, nxt = (list(r) for r in (rec["prompt_ids"], rec["output_ids"], records[i + 1]["prompt_ids"]))
        case, h = classify_boundary(prompt, out, nxt, tok)
        boundaries.append([case, h])
        if case == "split":
            splits.append(i)
            segs.append(_Segment(records, i + 1, True))
            continue
        segs[-1].cases[case] += 1
        segs[-1].harness_drift += 0 if case == "strict" else _harness_drift(nxt[len(prompt):h], out)
        segs[-1].add_glue(nxt, i + 1, h)
    turn_ids = _turn_ids(records)
    samples = []
    for k, seg in enumerate(segs):
        tokens = np.asarray(seg.tokens, dtype=np.int64)  # (T,)
        samples.append({
            "task": name, "tokens": tokens, "loss_mask": np.asarray(seg.mask, dtype=np.int8),
            "rollout_logprobs": np.asarray(seg.logprobs, dtype=np.float64),
            "routed_experts": _routing(seg, records, name, replay),
            "reward": float(trial.get("reward", 0.0)), "passed": int(trial.get("passed", 0)),
            "total": int(trial.get("total", 0)), "reward_source": trial.get("reward_source"),
            "exit_reason": trial.get("exit_reason"), "turns": len(seg.turns),
            "weight_version": trial.get("weight_version", records[seg.turns[-1]].get("weight_version")),
            "cases": seg.cases, "segment": k, "n_segments": len(segs), "split_after_turns": splits,
            "spans": seg.spans, "sampled": seg.sampled, "harness_drift_tokens": seg.harness_drift,
            "turn_ids": turn_ids, "boundaries": boundaries,  # what the auditor checks the stream against
        })
    return samples


def _turn_ids(records) -> list:
    """Every turn's prompt and output ids as the sampler saw them (the auditor's reference), packed."""
    return pack_turns([[[int(t) for t in r["prompt_ids"]], [int(t) for t in r["output_ids"]]] for r in records])


def assemble(trial: dict, tok=None, replay: bool = False) -> dict:
    """The one training sample of a trial; a split boundary raises (use assemble_segments for those)."""
    samples = assemble_segments(trial, tok, replay)
    if len(samples) > 1:
        i = samples[0]["split_after_turns"][0]
        hint = "" if tok is not None else " (no tokenizer given: only strict boundaries are repaired)"
        raise ValueError(f"trial {trial.get('task', '?')!r} turn {i}: the next prompt does not extend the history "
                         f"(case split, {len(samples)} segments){hint}; use assemble_segments")
    return samples[0]


def assemble_naive(trial: dict, tok=None) -> dict:
    """What a trainer without TITO builds: the last prompt as the harness encoded it + the last output,
    loss on wherever each completion's re-encoded copy sits. Used by `measure` to show the drift."""
    records = trial["records"]
    last = records[-1]
    final = [int(t) for t in last["prompt_ids"]]
    tokens = final + [int(t) for t in last["output_ids"]]
    eot = end_of_turn_ids(tok) if tok is not None else set()
    mask, spans, sampled = [0] * len(tokens), [], []
    for i, rec in enumerate(records):
        p, out = [int(t) for t in rec["prompt_ids"]], [int(t) for t in rec["output_ids"]]
        if i + 1 == len(records):
            a, b = len(p), len(tokens)
        elif final[:len(p)] == p:  # the completion's copy: from the end of P_i to the next end-of-turn id
            rest = final[len(p):]
            e = next((k for k, t in enumerate(rest) if t in eot), len(rest))
            a, b = len(p), len(p) + e + (1 if e < len(rest) and out and out[-1] in eot else 0)
        else:
            a = b = len(p)  # the history was rewritten: the completion is nowhere in the stream
        mask[a:b] = [1] * (b - a)
        spans.append((a, b))
        sampled.append(out)
    return {"task": trial.get("task", "?"), "tokens": np.asarray(tokens, dtype=np.int64),
            "loss_mask": np.asarray(mask, dtype=np.int8), "cases": dict.fromkeys(CASES, 0),
            "spans": spans, "sampled": sampled, "harness_drift_tokens": 0, "segment": 0, "n_segments": 1,
            "turn_ids": _turn_ids(records), "layout": "naive"}


def case_counts(trial: dict, tok=None) -> dict:
    """Boundary cases of one trajectory (what assemble_segments repairs)."""
    counts = dict.fromkeys(CASES, 0)
    recs = trial["records"]
    for rec, nxt in zip(recs, recs[1:]):
        counts[classify_boundary(list(rec["prompt_ids"]), list(rec["output_ids"]), list(nxt["prompt_ids"]),
                                 tok)[0]] += 1
    return counts


# --- audit -------------------------------------------------------------------------------------------
# The auditor (`audit`, paper: "relocates every completion in the next prompt"): from the turn records the
# sample carries, completion i must appear in turn i+1's prompt where turn i's prompt ended (else a
# relocation failure is reported: the next turn saw other ids, e.g. a retokenized history), and the sampled
# ids are placed in the stream by the declared boundaries (the last completion inside the sample's tokens);
# drift = loss-region positions (m = 1) whose trained id is not the sampled id, plus sampled ids left at
# m = 0, over the loss-region tokens. `harness_drift_pct` reports what the naive stream would have drifted.

MAX_REPORTED = 20  # positions listed per kind in an audit report (the counts cover them all)


def _placements(s: dict) -> tuple[list, list, dict]:
    """Where the sampler's completions must sit in the sample's stream, from its trial's turn records.

    Relocation (the paper's auditor): completion i (record i's output ids) must appear in record i+1's prompt
    at the position where record i's prompt ended. The stream position of completion i follows from the
    boundaries the assembler declared: a segment starts at the prompt of its first turn (position 0); a strict
    boundary keeps the offset between stream and prompt; a repaired one (normalized / retokenized) resumes the
    next prompt at h right after completion i. -> ([(stream start, ids)], [relocation failure], cases)."""
    name = s.get("task", "?")
    if not s.get("turn_ids"):
        raise ValueError(f"sample {name!r}: no turn_ids (written before the auditor needed its trial's records); "
                         f"cannot audit it")
    turns = unpack_turns(s["turn_ids"])
    if s.get("layout") == "naive":  # assemble_naive: the harness's last prompt, each completion where its copy sits
        return [(len(p), o) for p, o in turns], [], dict.fromkeys(CASES, 0)
    bounds = s.get("boundaries")
    if bounds is None or len(bounds) != len(turns) - 1 or any(len(b) != 2 for b in bounds):
        raise ValueError(f"sample {name!r}: {len(turns)} turns need {len(turns) - 1} boundaries [case, h], got "
                         f"{None if bounds is None else str(bounds)[:80]}")
    want_seg, seg, off = int(s.get("segment", 0)), 0, 0
    placed, failures, cases = [], [], dict.fromkeys(CASES, 0)
    for i, (p, o) in enumerate(turns):
        start = len(p) + off  # stream position of completion i
        if seg == want_seg:
            placed.append((start, o))
        if i + 1 == len(turns):
            break
        nxt, (case, h) = turns[i + 1][0], bounds[i]
        if case not in CASES:
            raise ValueError(f"sample {name!r} turn {i}: unknown boundary case {case!r}")
        n, found = len(p), turns[i + 1][0][len(p):len(p) + len(o)]
        if seg == want_seg and found != o:  # relocation fails: the next turn was not conditioned on these ids
            k = next((k for k, (a, b) in enumerate(zip(o, found)) if a != b), min(len(o), len(found)))
            failures.append({"task": name, "turn": i, "case": case, "position": n + k,
                             "sampled": o[k] if k < len(o) else None, "found": found[k] if k < len(found) else None})
        if case == "split":
            seg, off = seg + 1, 0  # a new segment: the stream restarts at the next prompt
            cases["split"] += int(seg == want_seg)
            continue
        cases[case] += int(seg == want_seg)
        if case != "strict":
            if nxt[:n] != p or h is None or not n <= h <= len(nxt):
                raise ValueError(f"sample {name!r} turn {i}: boundary declared {case} at h = {h}, but the next prompt "
                                 f"does not extend this turn's prompt there")
            off = start + len(o) - h  # the stream holds P_{i+1}[h:] right after completion i
    return placed, failures, cases


def audit_sample(s: dict) -> dict:
    """Loss-region drift of one sample: trained `tokens` at every m = 1 position vs the sampled ids placed there.

    A position is drifted when m = 1 and the trained id differs from the sampled one (or nothing was sampled
    there), or when a sampled id sits at m = 0 or beyond the stream. -> counts and the drifted positions."""
    placed, failures, cases = _placements(s)
    tokens, mask = np.asarray(s["tokens"]), np.asarray(s["loss_mask"]) != 0  # (T,), (T,)
    if tokens.ndim != 1 or mask.shape != tokens.shape:
        raise ValueError(f"sample {s.get('task', '?')!r}: tokens {tokens.shape} and loss_mask {mask.shape} differ")
    want = np.full(len(tokens), -1, dtype=np.int64)  # (T,): the sampled id expected at j, -1 where none
    missing = 0
    for start, o in placed:
        inside = max(min(len(o), len(tokens) - start), 0)
        want[start:start + inside] = o[:inside]
        missing += len(o) - inside  # the last completion must lie inside the sample's tokens
    sampled_at = want >= 0
    bad = (mask & (tokens != want)) | (sampled_at & ~mask)  # (T,)
    pos = np.flatnonzero(bad)
    drift = [{"task": s.get("task", "?"), "segment": int(s.get("segment", 0)), "position": int(j),
              "trained": int(tokens[j]), "sampled": int(want[j]) if want[j] >= 0 else None, "mask": int(mask[j])}
             for j in pos[:MAX_REPORTED]]
    return {"loss_tokens": int((mask | sampled_at).sum()) + missing, "drifted_tokens": len(pos) + missing,
            "missing_tokens": missing, "drift": drift, "relocation": failures, "cases": cases}


def audit(samples: list[dict]) -> dict:
    """The paper's TITO auditor over samples that carry their trial's turn records (`turn_ids`, `boundaries`).

    loss_region_drift_pct = drifted loss-region tokens / loss-region tokens (percent, unrounded); relocation
    failures = completions not found in the next turn's prompt where their turn's prompt ended (a boundary the
    harness re-encoded or rewrote: the next turn saw other ids than the sampled ones)."""
    cases = dict.fromkeys(CASES, 0)
    loss_tokens = drifted = missing = harness = 0
    drift, relocation, n_reloc = [], [], 0
    for s in samples:
        r = audit_sample(s)
        for c in CASES:
            cases[c] += r["cases"][c]
        loss_tokens += r["loss_tokens"]
        drifted += r["drifted_tokens"]
        missing += r["missing_tokens"]
        n_reloc += len(r["relocation"])
        drift += r["drift"][:MAX_REPORTED - len(drift)]
        relocation += r["relocation"][:MAX_REPORTED - len(relocation)]
        harness += int(s.get("harness_drift_tokens", 0))
    pct = lambda k: 100.0 * k / loss_tokens if loss_tokens else 0.0  # noqa: E731
    return {"samples": len(samples), "cases": cases, "loss_tokens": loss_tokens, "drifted_tokens": drifted,
            "missing_tokens": missing, "loss_region_drift_pct": pct(drifted), "harness_drift_pct": pct(harness),
            "relocation_failures": n_reloc, "drift": drift, "relocation": relocation}


# --- samples on disk ---------------------------------------------------------------------------------

def _b64(a: np.ndarray, dtype) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def _unb64(s: str, dtype, shape=None) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(s), dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    return a.reshape(shape) if shape is not None else a


def pack_turns(turns: list) -> list:
    """[[prompt_ids, output_ids]] -> [[k, prompt_ids[k:], output_ids]], k = ids the prompt shares with the previous
    prompt + output: lossless, O(T) instead of O(turns x T) for an append-only history (a sample's `turn_ids`)."""
    out, prev = [], []
    for p, o in turns:
        k = next((k for k, (a, b) in enumerate(zip(p, prev)) if a != b), min(len(p), len(prev)))
        out.append([k, p[k:], o])
        prev = p + o
    return out


def unpack_turns(packed: list) -> list:
    """A sample's `turn_ids` -> [[prompt_ids, output_ids]] of every turn of its trial."""
    out, prev = [], []
    for turn in packed:
        if not isinstance(turn, (list, tuple)) or len(turn) != 3:
            raise ValueError(f"turn_ids: expected [k, prompt tail, output ids] per turn, got {str(turn)[:80]}")
        k, rest, o = turn
        if not isinstance(k, int) or not 0 <= k <= len(prev):
            raise ValueError(f"turn_ids: shared prefix {k!r} is not in [0, {len(prev)}] (the previous turn)")
        p = prev[:k] + list(rest)
        out.append([p, list(o)])
        prev = p + list(o)
    return out


def save_samples(path: str | Path, samples: list[dict]) -> None:
    """Write samples as JSONL (arrays as little-endian base64) so they read back bit for bit."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for s in samples:
            rec = {k: v for k, v in s.items() if not isinstance(v, np.ndarray) and k != "routed_experts"}
            rec["tokens"] = _b64(s["tokens"], np.int32)
            rec["loss_mask"] = _b64(s["loss_mask"], np.int8)
            rec["rollout_logprobs"] = _b64(s["rollout_logprobs"], np.float64)
            re = s.get("routed_experts")
            rec["routed_experts"] = None if re is None else {"shape": list(re.shape), "data": _b64(re, np.int32)}
            if s.get("turn_ids") is not None:
                rec["turn_ids"] = s["turn_ids"]
            f.write(json.dumps(rec) + "\n")
    tmp.replace(path)  # atomic: a crash never leaves half a file behind


def load_samples(path: str | Path) -> list[dict]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                rec["tokens"] = _unb64(rec["tokens"], np.int32).astype(np.int64)
                rec["loss_mask"] = _unb64(rec["loss_mask"], np.int8)
                rec["rollout_logprobs"] = _unb64(rec["rollout_logprobs"], np.float64)
                re = rec.get("routed_experts")
                rec["routed_experts"] = None if re is None else _unb64(re["data"], np.int32, re["shape"])
                rec["spans"] = [tuple(x) for x in rec["spans"]]
                if rec.get("turn_ids") is not None:
                    unpack_turns(rec["turn_ids"])  # refuse a malformed record here, naming its line
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}: line {n} is not a sample record ({e})") from e
            out.append(rec)
    return out


def main(args):
    """`audit` (build_parser's arguments) -> exit status: 1 when a loss-region token drifted."""
    path = Path(args.samples_path)
    files = sorted(path.glob("**/*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        sys.exit(f"tito audit: no sample files at {path}")
    try:
        report = audit([s for f in files for s in load_samples(f)])
    except ValueError as e:
        sys.exit(f"tito audit: {e}")
    if args.json:
        print(json.dumps(report))
    else:
        print(f"samples {report['samples']}  cases " + " ".join(f"{k}={v}" for k, v in report["cases"].items()))
        print(f"loss-region drift {report['loss_region_drift_pct']:.4f}% "
              f"({report['drifted_tokens']} of {report['loss_tokens']} loss tokens); "
              f"the harness's own copies would drift {report['harness_drift_pct']:.4f}%")
        print(f"completions not relocated in the next prompt: {report['relocation_failures']}")
        for d in report["drift"]:
            print(f"  drift: {d}")
        for r in report["relocation"]:
            print(f"  relocation: {r}")
    return 1 if report["drifted_tokens"] else 0  # a wrong token in the loss region: the audit fails


if __name__ == "__main__":
    sys.exit(main(ARGV))
