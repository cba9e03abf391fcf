"""TITO: train on the exact sampled token ids. Trajectory assembly, four-case boundary repair, loss mask, audit.

Paper section "TITO" (T1, arXiv 2609.11042): token fidelity T^t_j = T^r_j, the trainer conditions on
the token ids the sampler actually produced. Encoding happens once per turn; the chat template is
pinned so rendering is append-only; where a harness still forces a mismatch, every turn boundary is
repaired by the first of four escalating cases that applies; sampled tokens get m = 1, tool output
and template glue m = 0; an auditor relocates every completion in the training stream and reports
token drift in the loss region ("0.0000% in the 1,402-sample production audit"). The harness's
re-tokenized copy of a completion never enters the training stream.

The loss-mask convention (stated once, used everywhere: critic.py, train_t1.py, r3.py):
    m[j] = 1  iff  token j of the sample was sampled by the policy (it has a rollout logprob);
    m[j] = 0  for prompt, tool output and template glue.
    Per-token tensors are indexed by j: logprobs[j] = log pi(tokens[j] | tokens[:j]). The routing row
    R[j] is the router's choice when token j is the *input*, so it shapes the prediction of token j+1:
    a placeholder routing row is allowed only where m[j+1] = 0 (paper, R3).

The four cases of a turn boundary (P_i = prompt ids of turn i, O_i = its sampled ids, P_{i+1} = the
next prompt as the harness built it; the first case that applies wins):
    strict       P_{i+1} extends P_i + O_i token for token.
    normalized   P_{i+1} extends P_i, and the harness's copy X of the completion (the ids of P_{i+1}
                 after P_i up to the first end-of-turn id) equals O_i after boundary normalisation:
                 drop trailing end-of-turn ids (<|im_end|>, <|endoftext|>, eos), then whitespace-only
                 tokens at both ends. (Clients strip the reply; the template re-adds <|im_end|>.)
    retokenized  P_{i+1} extends P_i and decode(X).strip() == decode(O_i minus end-of-turn).strip(),
                 with different ids: the harness re-encoded the text of the history.
    split        anything else (P_{i+1} rewrote earlier history: summarisation, truncation, an edited
                 reply): a new segment starts at P_{i+1}.
Repair (strict, normalized, retokenized): the training stream continues with O_i exactly as sampled
(m = 1), then the glue G = P_{i+1}[h:] (h = end of X in P_{i+1}; the harness's end-of-turn id is skipped
when O_i already ends with one), m = 0. So one sample per segment holds the sampled ids in the loss
region and the harness's own ids everywhere else; X itself (the re-encoded copy) is dropped. The turn
i+1 completion was sampled conditioned on X, the trainer conditions it on O_i: for normalized and
retokenized boundaries this is a small off-policy shift in the *context* (same text, other ids) that the
PPO ratio absorbs, never a wrong token in the loss region. Routing rows follow the stream: rows of
P_s and of O_i from the record that first forwarded them, glue rows from the prefill of P_{i+1}
(the sampler's own choice at that token), and the row of O_i's last token (which predicts glue, m = 0)
from P_{i+1}'s prefill at h-1 (exact when strict, the nearest analogue otherwise).

Sample record (one per segment; one per trajectory unless a boundary split; `save_samples` /
`load_samples` read back exactly):
    task, tokens (T,), loss_mask (T,), rollout_logprobs (T,) (0 where m = 0),
    routed_experts (T-1, L, k) int32 or None, reward, passed, total, reward_source, exit_reason,
    turns, weight_version, cases {strict, normalized, retokenized, split} (boundaries inside the
    segment, plus the split that opened it), segment, n_segments, spans [(start, end)] of each
    completion, sampled [[ids]] (the engine's output ids), relocated [[ids]] (the ids the training
    stream holds at each completion's span: what the next turn is conditioned on), harness_drift_tokens
    (sampled ids the harness's own copy got wrong: what naive retokenization would have trained on).
The trajectory's reward goes on the last token of every segment.

CLI:
    python tito.py audit SAMPLES_PATH [--json]   # case counts + loss-region drift (4 decimals)
    python tito.py measure --quick               # naive vs TITO through the token gateway (gateway.py)

Departures from the paper:
  1. A split boundary yields one more sample (segment) carrying the trajectory's reward; the paper does
     not say how a split trajectory is trained. `assemble(trial)` refuses a split (one sample per trial
     is what train_t1.py expects); `assemble_segments(trial, tok)` returns every segment.
  2. normalized / retokenized need the tokenizer (`tok`) to tell whitespace and text apart; without it
     only strict is repaired and any other boundary is a split. The native harness (rollout.py) is
     token-first, so every boundary there is strict by construction (the paper's future-work fix for
     its residual 2.6% retokenized tokens).
  3. The auditor checks the training stream against the sampler's ids stored in the sample (`sampled`);
     the paper's auditor relocates completions in the next prompt. `harness_drift_pct` reports the
     drift the naive stream (the harness's own ids) would have had.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import numpy as np

CASES = ("strict", "normalized", "retokenized", "split")


# --- boundary classification -------------------------------------------------------------------------

def end_of_turn_ids(tok) -> set[int]:
    """Ids that close a turn: <|im_end|>, <|endoftext|> and the tokenizer's eos (those it has)."""
    ids = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
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


def _routing(seg: _Segment, records, name) -> np.ndarray | None:
    """Routing (T-1, L, k) of a segment, each row from the forward that computed it (see the docstring)."""
    have = [r.get("routed_experts") is not None for r in records]
    if not any(have):
        return None
    shape = None
    for i, rec in enumerate(records):  # a missing capture aborts (R3), never silently drops
        need = len(rec["prompt_ids"]) + len(rec["output_ids"]) - 1
        re = rec.get("routed_experts")
        if re is None or re.ndim != 3 or re.shape[0] != need or (shape is not None and re.shape[1:] != shape):
            got = None if re is None else tuple(re.shape)
            want = (need,) + (tuple(shape) if shape is not None else ("L", "k"))
            raise ValueError(f"trial {name!r} turn {i}: routed experts missing or wrongly shaped: "
                             f"expected {want}, got {got} (R3: a missing capture aborts)")
        shape = shape or re.shape[1:]
    out = np.empty((len(seg.tokens) - 1,) + tuple(shape), dtype=np.int32)  # (T-1, L, k)
    for j, (i, r) in enumerate(seg.rows[:-1]):
        out[j] = records[i]["routed_experts"][r]
    return out


def assemble_segments(trial: dict, tok=None) -> list[dict]:
    """Training samples of a trial from its per-turn records: one per segment (four-case repair)."""
    records = trial.get("records") or []
    name = trial.get("task", "?")
    if not records:
        raise ValueError(f"trial {name!r}: no model turns recorded, nothing to train on")
    segs, splits = [_Segment(records, 0, False)], []
    for i, rec in enumerate(records):
        segs[-1].add_output(rec, i, name)
        if i + 1 == len(records):
            break
        prompt, out, nxt = (list(r) for r in (rec["prompt_ids"], rec["output_ids"], records[i + 1]["prompt_ids"]))
        case, h = classify_boundary(prompt, out, nxt, tok)
        if case == "split":
            splits.append(i)
            segs.append(_Segment(records, i + 1, True))
            continue
        segs[-1].cases[case] += 1
        segs[-1].harness_drift += 0 if case == "strict" else _harness_drift(nxt[len(prompt):h], out)
        segs[-1].add_glue(nxt, i + 1, h)
    samples = []
    for k, seg in enumerate(segs):
        tokens = np.asarray(seg.tokens, dtype=np.int64)  # (T,)
        samples.append({
            "task": name, "tokens": tokens, "loss_mask": np.asarray(seg.mask, dtype=np.int8),
            "rollout_logprobs": np.asarray(seg.logprobs, dtype=np.float64),
            "routed_experts": _routing(seg, records, name),
            "reward": float(trial.get("reward", 0.0)), "passed": int(trial.get("passed", 0)),
            "total": int(trial.get("total", 0)), "reward_source": trial.get("reward_source"),
            "exit_reason": trial.get("exit_reason"), "turns": len(seg.turns),
            "weight_version": trial.get("weight_version", records[seg.turns[-1]].get("weight_version")),
            "cases": seg.cases, "segment": k, "n_segments": len(segs), "split_after_turns": splits,
            "spans": seg.spans, "sampled": seg.sampled,
            "relocated": [[int(t) for t in tokens[a:b]] for a, b in seg.spans],
            "harness_drift_tokens": seg.harness_drift,
        })
    return samples


def assemble(trial: dict, tok=None) -> dict:
    """The one training sample of a trial; a split boundary raises (use assemble_segments for those)."""
    samples = assemble_segments(trial, tok)
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
    mask, spans, sampled, relocated = [0] * len(tokens), [], [], []
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
        relocated.append(tokens[a:b])
    return {"task": trial.get("task", "?"), "tokens": np.asarray(tokens, dtype=np.int64),
            "loss_mask": np.asarray(mask, dtype=np.int8), "cases": dict.fromkeys(CASES, 0),
            "spans": spans, "sampled": sampled, "relocated": relocated, "harness_drift_tokens": 0}


def case_counts(trial: dict, tok=None) -> dict:
    """Boundary cases of one trajectory (what assemble_segments repairs)."""
    counts = dict.fromkeys(CASES, 0)
    recs = trial["records"]
    for rec, nxt in zip(recs, recs[1:]):
        counts[classify_boundary(list(rec["prompt_ids"]), list(rec["output_ids"]), list(nxt["prompt_ids"]), tok)[0]] += 1
    return counts


# --- audit -------------------------------------------------------------------------------------------

def audit(samples: list[dict]) -> dict:
    """Relocate every completion in the training stream; count ids that differ from the sampled ones."""
    cases = dict.fromkeys(CASES, 0)
    loss_tokens = drifted = harness = 0
    for s in samples:
        for c in CASES:
            cases[c] += int(s["cases"].get(c, 0))
        sampled = s.get("sampled") or [list(s["tokens"][a:b]) for a, b in s["spans"]]  # old records: the stream
        for want, found in zip(sampled, s["relocated"]):
            loss_tokens += len(want)
            drifted += _harness_drift(list(found), list(want))
        harness += int(s.get("harness_drift_tokens", 0))
        if int(s["loss_mask"].sum()) != sum(e - b for b, e in s["spans"]):
            raise ValueError(f"sample {s['task']!r}: loss mask does not cover exactly the sampled spans")
    pct = lambda k: round(100.0 * k / loss_tokens, 4) if loss_tokens else 0.0  # noqa: E731
    return {"samples": len(samples), "cases": cases, "loss_tokens": loss_tokens, "drifted_tokens": drifted,
            "loss_region_drift_pct": pct(drifted), "harness_drift_pct": pct(harness)}


# --- samples on disk ---------------------------------------------------------------------------------

def _b64(a: np.ndarray, dtype) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def _unb64(s: str, dtype, shape=None) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(s), dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    return a.reshape(shape) if shape is not None else a


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
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}: line {n} is not a sample record ({e})") from e
            out.append(rec)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("audit", help="audit samples written by a run (a .jsonl file or a directory of them)")
    a.add_argument("samples_path")
    a.add_argument("--json", action="store_true")
    m = sub.add_parser("measure", help="naive retokenization vs TITO through the token gateway (one JSON line)")
    m.add_argument("--quick", action="store_true", help="a few tasks and turns (minutes on 2 CPU cores)")
    m.add_argument("--harness", choices=["client", "harbor"], default="client",
                   help="client: a text client that re-renders the history like Terminus-2; harbor: Harbor's own")
    m.add_argument("--work-dir", default=None)
    args = p.parse_args(argv)
    if args.cmd == "measure":
        import gateway
        print(json.dumps(gateway.measure(quick=args.quick, harness=args.harness, work_dir=args.work_dir)))
        return
    path = Path(args.samples_path)
    files = sorted(path.glob("**/*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        sys.exit(f"tito audit: no sample files at {path}")
    report = audit([s for f in files for s in load_samples(f)])
    if args.json:
        print(json.dumps(report))
    else:
        print(f"samples {report['samples']}  cases " + " ".join(f"{k}={v}" for k, v in report["cases"].items()))
        print(f"loss-region drift {report['loss_region_drift_pct']:.4f}% "
              f"({report['drifted_tokens']} of {report['loss_tokens']} loss tokens); "
              f"the harness's own copies would drift {report['harness_drift_pct']:.4f}%")


if __name__ == "__main__":
    main()
