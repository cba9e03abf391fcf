"""The report a run prints at its end, and the statistics the experiments reuse.

train_t1.train calls best_val (the RL step its validation set chose), async_vs_sequential (the one-step async
overlap's step time), plot (the run's curves, RUN/curves.png) and print_table (held-out solve rate and mean reward of
each checkpoint with 95% intervals, the paired tests RL vs SFT, the phase times). experiments/ reuses the statistics:
wilson (a proportion's interval), mean_interval, mcnemar_p and paired (two evaluations of the same trials).

    python -m experiments.bench plot RUN [--out PNG]   # a run's curves again (RUN/curves.png by default)
    python -m experiments.bench compare A B            # two evaluations paired (one JSON line)

Imports no project module (numpy; matplotlib only when plotting), so the entry point and the experiments share it
without depending on each other.
"""
import json
import math
from pathlib import Path

import numpy as np


# --- intervals and paired tests -----------------------------------------------------------------------------------
def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion k / n."""
    if n == 0:
        return float("nan"), float("nan")
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def mean_interval(xs: list, z: float = 1.96) -> tuple[float, float]:
    """95% normal interval of a mean (the standard error of xs)."""
    n = len(xs)
    if n < 2:
        return float("nan"), float("nan")
    m = sum(xs) / n
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)
    return m - z * se, m + z * se


def mcnemar_p(gain: int, loss: int) -> float:
    """Exact two-sided McNemar p over the discordant pairs: 2 P(X <= min(gain, loss)), X ~ Bin(gain + loss, 1/2)."""
    m = gain + loss
    return min(1.0, 2 * sum(math.comb(m, i) for i in range(min(gain, loss) + 1)) / 2 ** m) if m else 1.0


def signflip_p(diffs, n_perm: int = 20000, seed: int = 0) -> float:
    """Two-sided paired sign-flip permutation p of mean(diffs) = 0 (diffs: one per task): every sign pattern when
    2^n <= n_perm, else n_perm random ones (the observed pattern counted: p > 0)."""
    d = np.asarray([x for x in diffs if x != 0], dtype=float)  # a zero flips to itself
    if not len(d):
        return 1.0
    obs = abs(d.sum())
    if 2 ** len(d) <= n_perm:
        signs = 1 - 2 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)
        return float(np.mean(np.abs(signs @ d) >= obs - 1e-12))
    signs = 1 - 2 * np.random.default_rng(seed).integers(0, 2, (n_perm, len(d)))
    return float((np.sum(np.abs(signs @ d) >= obs - 1e-12) + 1) / (n_perm + 1))


def paired(a: dict, b: dict, n_boot: int = 2000, seed: int = 0) -> dict:
    """b against a over the same (task, attempt) trials: exact two-sided McNemar p on the solved / unsolved flips
    (over trials: exact with one attempt per task, too small a p with several: a task's attempts are not
    independent), the sign-flip p over tasks of the attempt-averaged solved difference (task_p: the test with
    several attempts; test names the one to quote), and the paired bootstrap over tasks of the mean-reward
    difference: its 95% interval and one-sided p of b <= a. a, b: evaluations (rollout.evaluate_trials)."""
    ka = {(t["task"], t["attempt"]): t for t in a["trials"]}
    kb = {(t["task"], t["attempt"]): t for t in b["trials"]}
    if set(ka) != set(kb):
        raise ValueError(f"paired: the two evaluations cover different trials ({len(ka)} vs {len(kb)})")
    keys = sorted(ka)
    gain = sum(kb[k]["resolved"] and not ka[k]["resolved"] for k in keys)
    loss = sum(ka[k]["resolved"] and not kb[k]["resolved"] for k in keys)
    p = mcnemar_p(gain, loss)
    d = [kb[k]["reward"] - ka[k]["reward"] for k in keys]
    per_task = {}  # the bootstrap resamples tasks (their attempts together: attempts of one task are not independent)
    for k, x in zip(keys, d):
        per_task.setdefault(k[0], []).append(x)
    groups = [np.array(v) for v in per_task.values()]
    rng, boots = np.random.default_rng(seed), []
    for _ in range(n_boot):
        pick = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        boots.append(float(np.concatenate(pick).mean()))
    boots.sort()
    solved = {}  # per task: b's solved minus a's, averaged over its attempts
    for k in keys:
        solved.setdefault(k[0], []).append(float(kb[k]["resolved"]) - float(ka[k]["resolved"]))
    attempts = max((len(v) for v in solved.values()), default=1)
    task_p = signflip_p([sum(v) / len(v) for v in solved.values()], seed=seed)
    return {"n": len(keys), "n_tasks": len(solved), "solved_gained": gain, "solved_lost": loss, "mcnemar_p": p,
            "task_p": task_p, "test": "McNemar" if attempts == 1 else "sign-flip over tasks",
            "solve_p": p if attempts == 1 else task_p,
            "reward_diff": sum(d) / len(d) if d else 0.0,
            "reward_diff_ci": (boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]),
            "reward_p_le": sum(x <= 0 for x in boots) / n_boot}


# --- the run's figures: the step validation chose, async vs sequential ----------------------------------------
def best_val(run_dir) -> dict | None:
    """The RL step chosen on the validation set (--n-val-tasks): of the steps > 0 with both evaluations on disk
    (evals/val_step_N.json and evals/step_N.json), the one with the highest validation solve rate, then mean
    reward, then the earlier step; -> that step's held-out evaluation with step, val_solve_rate, val_reward_mean
    and val_n added, or None (no validation set). Chosen on validation alone: the held-out figures are not read."""
    evals, best = Path(run_dir) / "evals", None
    for f in sorted(evals.glob("val_step_*.json")) if evals.is_dir() else []:
        step = int(f.stem[len("val_step_"):])
        if step == 0 or not (evals / f"step_{step:06d}.json").exists():
            continue
        try:
            v = json.loads(f.read_text())
            key = (float(v["solve_rate"]), float(v["reward_mean"]), -step)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"best_val: {f} is not a validation evaluation (runstate.eval_row): "
                             f"{type(e).__name__}: {e}") from None
        if best is None or key > best[0]:
            best = (key, step, v)
    if best is None:
        return None
    _, step, v = best
    held = json.loads((evals / f"step_{step:06d}.json").read_text())
    return {**held, "step": step, "val_solve_rate": v["solve_rate"], "val_reward_mean": v["reward_mean"],
            "val_n": v["n_trials"]}


def async_vs_sequential(run_dir) -> dict:
    """Step time with the next rollout beside the update (async) vs rollout then update (sequential).

    Target: async step <= 1.15 x max(rollout, update), both measured in sequential steps of the run.
    """
    rl = [json.loads(l) for l in open(Path(run_dir) / "metrics.jsonl") if json.loads(l)["phase"] == "rl"]
    nxt = {r["step"] - 1: r for r in rl}
    seq = [r for r in rl if not r.get("rollout_beside_update") and not r.get("sampled_beside_update")
           and "time_train" in r]  # rollout, then update, nothing beside
    asy = [r for r in rl if r.get("rollout_beside_update") and r.get("sampled_beside_update") and r["step"] in nxt
           and "time_train" in r]  # steady state: own rollout ran beside the last update, the next beside this one
    out = {"n_sequential": len(seq), "n_async": len(asy)}
    if seq:
        out.update(sequential_step_s=float(np.mean([r["time_step"] for r in seq])),
                   sequential_rollout_s=float(np.mean([r["time_rollout"] for r in seq])),
                   sequential_train_s=float(np.mean([r["time_train"] for r in seq])))
    if asy:
        out.update(async_step_s=float(np.mean([r["time_step"] for r in asy])),
                   async_over_own_max=float(np.mean([r["time_step"]
                                                     / max(nxt[r["step"]]["time_rollout"], r["time_train"])
                                                     for r in asy])))
    if seq and asy:
        out["async_over_sequential_max"] = out["async_step_s"] / max(out["sequential_rollout_s"],
                                                                     out["sequential_train_s"])
    return out


# --- the end-of-run table and curves --------------------------------------------------------------------------
# the splits' names in the table (runstate.SPLITS: the run's evaluation splits), the in-template test split first
TITLES = {"test": "test (in-template)", "test_deep": "test (out-of-template: deeper RST)",
          "test_names": "test (unseen names)", "val": "validation"}


def _row(pool: str, name: str, e: dict) -> str:
    if "trials" not in e:  # recorded by a version that kept no per-trial rows: no intervals to give
        return (f"| {pool} | {name} | {e['solve_rate']:.3f} [n/a] | {e['reward_mean']:.3f} [n/a] | "
                f"{e['turns_mean']:.1f} | {e['n_trials']} |")
    lo, hi = wilson(sum(t["resolved"] for t in e["trials"]), e["n_trials"])
    rlo, rhi = mean_interval([t["reward"] for t in e["trials"]])
    return (f"| {pool} | {name} | {e['solve_rate']:.3f} [{lo:.3f}, {hi:.3f}] | {e['reward_mean']:.3f} "
            f"[{rlo:.3f}, {rhi:.3f}] | {e['turns_mean']:.1f} | {e['n_trials']} |")


def print_table(summary: dict) -> None:
    """The end-of-run table: solve rate and mean reward of each checkpoint on every split the run drew (the
    in-template test split, the other test splits, validation, the first training tasks) with 95% intervals and n
    (with a validation curve, also the RL step it chose: RL@val, when not the last), then the paired tests RL vs SFT
    on each split (and RL@val vs SFT, SFT vs base on the in-template test split), then the phase times."""
    print("\n| split | checkpoint | solve rate [95% CI] | mean reward P/S [95% CI] | mean turns | n |\n"
          "|---|---|---|---|---|---|")
    rl_step = (summary.get("eval_rl") or {}).get("after_step")
    best = summary.get("eval_rl_best_val")
    if best and best.get("step") == rl_step:
        best = None  # validation chose the last step: the RL row already is it
    evs = {"test": {"base": summary.get("eval_base"), "sft": summary.get("eval_sft"), "rl": summary.get("eval_rl"),
                    "rl_best_val": best}}
    for split in ("test_deep", "test_names", "val"):
        evs[split] = {ck: (summary.get(f"eval_{ck}_splits") or {}).get(split) for ck in ("sft", "rl")}
    evs["train (first tasks)"] = {ck: summary.get(f"eval_{ck}_train") for ck in ("sft", "rl")}
    for split, by_ck in evs.items():
        for ck, e in by_ck.items():
            if e and e.get("n_trials"):
                best_name = f"RL@val (step {e.get('step')}, val {e.get('val_solve_rate', 0):.3f})"
                print(_row(TITLES.get(split, split), best_name if ck == "rl_best_val" else ck.upper(), e))
    pairs = [(split, "sft", "rl") for split in evs if split != "train (first tasks)"]
    pairs += [("test", "sft", "rl_best_val"), ("test", "base", "sft")]
    for split, a, b in pairs:
        ea, eb = evs[split].get(a), evs[split].get(b)
        if ea and eb and ea.get("trials") and eb.get("trials"):
            t = paired(ea, eb)
            name = f"RL@val (step {eb['step']})" if b == "rl_best_val" else b.upper()
            print(f"{TITLES[split]}: {name} vs {a.upper()} (paired, {t['n_tasks']} tasks, n {t['n']}): solved "
                  f"+{t['solved_gained']} -{t['solved_lost']}, {t['test']} p = {t['solve_p']:.3g}; mean reward "
                  f"{t['reward_diff']:+.3f} "
                  f"[{t['reward_diff_ci'][0]:+.3f}, {t['reward_diff_ci'][1]:+.3f}], bootstrap p(<= 0) = "
                  f"{t['reward_p_le']:.3g}")
    print("\n| phase | wall time (s) |\n|---|---|")
    for k, v in summary["phase_times"].items():
        print(f"| {k} | {v:.0f} |")


def plot(run_dir, out=None) -> Path:
    """PNG curves of a run: reward and solve rate (training rollouts; every split's evaluations), EV (warm-up, RL),
    |dlogp|, turns, step times, SFT loss -> the path written: `out`, by default run_dir/curves.png."""
    import matplotlib  # lazily: only a run's end and the plot command draw
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run_dir = Path(run_dir)
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl")] if (run_dir / "metrics.jsonl").exists() else []
    rl = [r for r in recs if r["phase"] == "rl"]
    panels = [("reward_mean", "reward (P/S)"), ("solve_rate", "solve rate"),
              ("explained_variance", "explained variance"), ("dlogp", "|dlogp| (R3 on)"), ("turns_mean", "turns"),
              ("time_step", "step time (s)")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    axes = axes.ravel()
    evals = [r for r in recs if r["phase"] == "eval"]  # step 0: SFT; the last; validation every --eval-every steps
    for ax, (k, title) in zip(axes, panels):
        ax.plot([r["step"] for r in rl], [r.get(k) for r in rl], marker="o", label="training rollouts")
        if k in ("reward_mean", "solve_rate") and evals:
            for prefix, name, marker in (("heldout", TITLES["test"], "s"), ("test_deep", TITLES["test_deep"], "v"),
                                         ("test_names", TITLES["test_names"], "D"), ("val", TITLES["val"], "^")):
                rows = [r for r in evals if f"{prefix}_{k}" in r]  # the splits a row evaluated
                if rows:
                    ax.plot([r["step"] for r in rows], [r[f"{prefix}_{k}"] for r in rows], marker=marker, label=name)
            ax.legend()
        if k == "dlogp":  # the R3-off diagnostic runs every --r3-off-every steps: NaN (or absent) on the others
            off = [r for r in rl if isinstance(r.get("dlogp_r3_off"), (int, float))
                   and math.isfinite(r["dlogp_r3_off"])]
            ax.plot([r["step"] for r in off], [r["dlogp_r3_off"] for r in off], marker="x", label="R3 off")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("RL step")
    warm = [r for r in recs if r["phase"] == "critic_warmup"]
    axes[6].plot([r["step"] for r in warm], [r["explained_variance"] for r in warm], marker=".")
    axes[6].set_title("critic warm-up EV")
    sft_recs = [r for r in recs if r["phase"] == "sft"]
    axes[7].plot([r["step"] for r in sft_recs], [r["sft_loss"] for r in sft_recs])
    axes[7].set_title("SFT loss")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
