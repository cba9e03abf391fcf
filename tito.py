"""TITO: train on the exact sampled token ids. Trajectory assembly, boundary check, loss mask, audit.

Paper section "TITO" (T1, arXiv 2609.11042): token fidelity T^t_j = T^r_j, the trainer conditions on
the token ids the sampler actually produced. Encoding happens once per turn; the chat template is
pinned so rendering is append-only; every turn boundary is classified strict / normalized /
retokenized / split; sampled tokens get m = 1, tool output and template glue m = 0; an auditor
relocates every completion in the next turn's prompt and reports token drift in the loss region
("0.0000% in the 1,402-sample production audit").

The loss-mask convention (stated once, used everywhere: critic.py, train_t1.py, r3.py):
    m[j] = 1  iff  token j of the sample was sampled by the policy (it has a rollout logprob);
    m[j] = 0  for prompt, tool output and template glue.
    Per-token tensors are indexed by j: logprobs[j] = log pi(tokens[j] | tokens[:j]). The routing row
    R[j] is the router's choice when token j is the *input*, so it shapes the prediction of token j+1:
    a placeholder routing row is allowed only where m[j+1] = 0 (paper, R3).

Sample record (one per trajectory; `save_samples` / `load_samples` read back exactly):
    task, tokens (T,), loss_mask (T,), rollout_logprobs (T,) (0 where m = 0),
    routed_experts (T-1, L, k) int32 or None, reward, passed, total, reward_source, exit_reason,
    turns, weight_version, cases {strict, normalized, retokenized, split},
    spans [(start, end)] of each completion, relocated [[ids]]: the ids found at each completion's
    offset in the *next* turn's prompt (what the auditor checks).

CLI:
    python tito.py audit SAMPLES_PATH [--json]   # case counts + loss-region drift (4 decimals)

Departures from the paper (this is the spine's first version; the issue "TITO complete" adds the
normalized / retokenized repairs and the OpenAI-compatible token gateway for text harnesses):
  1. Only the strict case is assembled. Our native harness (rollout.py) is token-first, so every
     boundary is strict by construction; a non-strict boundary raises a clear error naming the trial
     and turn instead of being repaired.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import numpy as np

CASES = ("strict", "normalized", "retokenized", "split")


def classify_boundary(prev_ids: list[int], next_prompt: list[int]) -> str:
    """Case of one turn boundary: prev_ids = prompt_i + output_i, next_prompt = prompt_{i+1}."""
    if len(next_prompt) >= len(prev_ids) and next_prompt[: len(prev_ids)] == prev_ids:
        return "strict"  # the next prompt extends prompt + output token for token
    return "split"


def assemble(trial: dict) -> dict:
    """One training sample from a trial's per-turn records (token ids, mask, logprobs, routing)."""
    records = trial.get("records") or []
    name = trial.get("task", "?")
    if not records:
        raise ValueError(f"trial {name!r}: no model turns recorded, nothing to train on")
    cases = dict.fromkeys(CASES, 0)
    spans, relocated = [], []
    for i, (rec, nxt) in enumerate(zip(records, records[1:])):
        prev = list(rec["prompt_ids"]) + list(rec["output_ids"])
        case = classify_boundary(prev, list(nxt["prompt_ids"]))
        if case != "strict":
            raise ValueError(f"trial {name!r} turn {i}: the next prompt does not extend prompt + output "
                             f"token for token (case {case}); the native harness must be token-first")
        cases[case] += 1
    last = records[-1]
    tokens = np.asarray(list(last["prompt_ids"]) + list(last["output_ids"]), dtype=np.int64)  # (T,)
    T = len(tokens)
    loss_mask = np.zeros(T, dtype=np.int8)
    logprobs = np.zeros(T, dtype=np.float64)
    for i, rec in enumerate(records):
        start, n = len(rec["prompt_ids"]), len(rec["output_ids"])
        loss_mask[start:start + n] = 1  # m = 1 exactly on sampled tokens
        lp = rec.get("output_logprobs")
        if lp is not None:
            if len(lp) != n:
                raise ValueError(f"trial {name!r} turn {i}: {len(lp)} logprobs for {n} sampled tokens")
            logprobs[start:start + n] = lp
        spans.append((start, start + n))
        nxt = records[i + 1]["prompt_ids"] if i + 1 < len(records) else tokens
        relocated.append([int(t) for t in nxt[start:start + n]])
    return {
        "task": name, "tokens": tokens, "loss_mask": loss_mask, "rollout_logprobs": logprobs,
        "routed_experts": assemble_routing(records, name),
        "reward": float(trial.get("reward", 0.0)), "passed": int(trial.get("passed", 0)),
        "total": int(trial.get("total", 0)), "reward_source": trial.get("reward_source"),
        "exit_reason": trial.get("exit_reason"), "turns": len(records),
        "weight_version": trial.get("weight_version", last.get("weight_version")),
        "cases": cases, "spans": spans, "relocated": relocated,
    }


def assemble_routing(records: list[dict], name: str = "?") -> np.ndarray | None:
    """Routing (T-1, L, k) of a whole trajectory: each row from the first forward that computed it.

    Rows of a turn's output come from the sampler's decode steps of that turn; rows of tool output and
    template glue come from the prefill of the next turn (paper, R3 "assembly across turns").
    Returns None when no record carries routing (scripted/oracle trials); a partial capture raises.
    """
    have = [r.get("routed_experts") is not None for r in records]
    if not any(have):
        return None
    rows, covered = [], 0
    for i, rec in enumerate(records):
        need = len(rec["prompt_ids"]) + len(rec["output_ids"]) - 1
        re = rec.get("routed_experts")
        if re is None or re.ndim != 3 or re.shape[0] != need or (rows and re.shape[1:] != rows[0].shape[1:]):
            got = None if re is None else tuple(re.shape)
            want = (need,) + (tuple(rows[0].shape[1:]) if rows else ("L", "k"))
            raise ValueError(f"trial {name!r} turn {i}: routed experts missing or wrongly shaped: "
                             f"expected {want}, got {got} (R3: a missing capture aborts)")
        rows.append(re[covered:need])
        covered = need
    return np.concatenate(rows, axis=0).astype(np.int32)


# --- audit -------------------------------------------------------------------------------------------

def audit(samples: list[dict]) -> dict:
    """Relocate every completion in the next turn's prompt; count drifted ids in the loss region."""
    cases = dict.fromkeys(CASES, 0)
    loss_tokens = drifted = 0
    for s in samples:
        for c in CASES:
            cases[c] += int(s["cases"].get(c, 0))
        for (start, end), found in zip(s["spans"], s["relocated"]):
            sampled = s["tokens"][start:end]
            loss_tokens += end - start
            drifted += sum(int(a != b) for a, b in zip(sampled, found)) + abs(len(sampled) - len(found))
        if int(s["loss_mask"].sum()) != sum(e - b for b, e in s["spans"]):
            raise ValueError(f"sample {s['task']!r}: loss mask does not cover exactly the sampled spans")
    pct = 100.0 * drifted / loss_tokens if loss_tokens else 0.0
    return {"samples": len(samples), "cases": cases, "loss_tokens": loss_tokens,
            "drifted_tokens": drifted, "loss_region_drift_pct": round(pct, 4)}


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
    args = p.parse_args(argv)
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
              f"({report['drifted_tokens']} of {report['loss_tokens']} loss tokens)")


if __name__ == "__main__":
    main()
