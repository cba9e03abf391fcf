"""The claims table of experiments/paper.py's runs: every arm's solve rate with its interval over seeds, then each
of the paper's claims beside ours, on the split it used, with the seed-blocked test of experiments/seeds.py (an arm
against ppo seed by seed; RL against its own seed's SFT, a shared SFT counted once) or, where there is no test, the
spread over seeds and no verdict; and the three pictures (reward, critic EV, R3's dlogp).

    python -m experiments.paper report OUT    # the table again from the run directories under OUT
"""
import datetime
import json
import math
from pathlib import Path

import numpy as np

from experiments.seeds import (SPLIT_NAMES, blocked_test, eval_files, load_eval, paired_arrays, t_interval,
                               t_quantile)
from report import wilson
from sandbox import task_io

HARD_MIN = 8  # the hard slice: held-out tasks with >= 8 assertions, where full solves are rare (dense reward's case)


def _interval(evals: list) -> tuple:
    """Mean solve rate of evaluations (one per seed) and its 95% interval: the wider of the t interval over the seeds
    (clipped to [0, 1]) and the Wilson interval of all their trials pooled (seeds that agree give a t interval of
    width 0, yet each still scored a sample of held-out tasks); one seed: its Wilson interval."""
    xs = [e["solve_rate"] for e in evals]
    m, lo, hi = float(np.mean(xs)), float("nan"), float("nan")
    if all(e.get("trials") for e in evals):
        lo, hi = wilson(sum(t["resolved"] for e in evals for t in e["trials"]),
                              sum(e["n_trials"] for e in evals))
    if len(xs) > 1:
        h = t_quantile(0.975, len(xs) - 1) * float(np.std(xs, ddof=1)) / math.sqrt(len(xs))
        lo, hi = np.nanmin([lo, max(m - h, 0.0)]), np.nanmax([hi, min(m + h, 1.0)])
    return m, float(lo), float(hi)


def _metrics(d: Path) -> list:
    p = d / "metrics.jsonl"
    return [r for r in (json.loads(l) for l in open(p)) if r["phase"] == "rl"] if p.exists() else []


def shared_runs(out: Path) -> list:
    """The shared runs under out: [OUT/shared], or OUT/shared-s0, -s1, ... (--sft-per-seed)."""
    one = out / "shared"
    per_seed = [d for d in out.glob("shared-s*") if d.name[len("shared-s"):].isdigit()]
    return [one] if one.is_dir() else sorted(per_seed, key=lambda d: int(d.name[len("shared-s"):]))


def collect(out: Path) -> dict:
    """Every finished arm run under out (OUT/<arm>-s<seed> with its summary.json): {arm: [{seed, dir, sft (the shared
    run it started from), summary, rl metrics rows, wall_s}]}."""
    arms = {}
    for d in sorted(out.glob("*-s*")):
        arm, _, seed = d.name.rpartition("-s")
        if arm == "shared" or not seed.isdigit() or not (d / "summary.json").exists():
            continue
        sm, own = json.loads((d / "summary.json").read_text()), out / f"shared-s{seed}"
        arms.setdefault(arm, []).append(dict(seed=int(seed), dir=d, sft=own if own.is_dir() else out / "shared",
                                             summary=sm, rl=_metrics(d),
                                             wall_s=sum(sm["phase_times"].values())))  # the arm's own phases
    return arms


def only(ev: dict, tasks: set | None) -> dict:
    """An evaluation restricted to the trials of `tasks` (None: all)."""
    return ev if tasks is None else dict(ev, trials=[t for t in ev.get("trials", []) if t["task"] in tasks])


def sft_eval(r: dict) -> dict:
    """An arm run's own SFT evaluation (split test): its summary's (a copy of its shared run's), else its shared
    run's."""
    return r["summary"].get("eval_sft") or json.loads((r["sft"] / "summary.json").read_text()).get("eval_sft") or {}


def split_evals(r: dict, split: str) -> tuple:
    """(SFT, final RL) evaluations of `split` for arm run r: its shared run's evals/ at step 0, its own at its last
    step; None where the file is missing."""
    step = r["summary"]["rl_steps"]
    fs, fr = eval_files(r["sft"]).get((split, 0)), eval_files(r["dir"]).get((split, step))
    return load_eval(fs, split, 0) if fs else None, load_eval(fr, split, step) if fr else None


def contrast(pairs: list) -> dict:
    """b against a, blocked by seed (experiments/seeds.py's test): pairs [(stratum, evaluation a, evaluation b)] over
    the same tasks, one pair per seed; the pairs of one stratum share their a (RL seeds from one shared SFT: its
    outcomes count once). -> {diff (mean over strata of mean_task(b - a), pass@1 with the attempts averaged), p
    (two-sided), per_seed, better / worse (tasks whose pass@1 rose / fell, summed over seeds), reward_diff, reward_p,
    n_seeds, n_strata}; {} without per-trial rows."""
    pairs = [(k, a, b) for k, a, b in pairs if a.get("trials") and b.get("trials")]
    if not pairs:
        return {}
    out = {"n_seeds": len(pairs), "n_strata": len({k for k, _, _ in pairs})}
    for key, name in (("resolved", ""), ("reward", "reward_")):
        strata, per_seed, better, worse = {}, [], 0, 0
        for k, a, b in pairs:
            x, y = paired_arrays(a, b, key, f"the pair of stratum {k}")
            strata.setdefault(k, (x, []))[1].append(y)
            per_seed.append(float((y - x).mean()))
            better, worse = better + int((y > x).sum()), worse + int((y < x).sum())
        t = blocked_test([(x, np.array(ys)) for x, ys in strata.values()])
        out.update({f"{name}diff": t["stat"], f"{name}p": min(1.0, 2 * min(t["p_greater"], t["p_less"])),
                    f"{name}per_seed": per_seed}, **({} if name else {"better": better, "worse": worse}))
    return out


def said(c: dict, a: str, b: str) -> str:
    """A contrast in words: b - a in solve rate (per seed), tasks better / worse, the test's p; the mean reward's."""
    _, lo, hi = t_interval(c["per_seed"])
    per = "" if c["n_seeds"] < 2 else (f" (per seed {', '.join(f'{x:+.3f}' for x in c['per_seed'])}; 95% t "
                                       f"interval over seeds [{lo:+.3f}, {hi:+.3f}])")
    one = "" if c["n_strata"] == c["n_seeds"] else f" against {c['n_strata']} shared {a} evaluation(s)"
    return (f"{b} - {a}: solve rate {c['diff']:+.3f}{per}, tasks +{c['better']} -{c['worse']} over {c['n_seeds']} "
            f"seed(s){one}, seed-blocked sign-flip p = {c['p']:.3g}; mean reward {c['reward_diff']:+.3f} (p = "
            f"{c['reward_p']:.3g})")


def assertion_counts(shared: Path) -> dict | None:
    """{held-out task name: its assertion count} from a shared run's task directories (paths as the run wrote them,
    relative to where it ran); None when they are not found from here."""
    st = json.loads((shared / "state.json").read_text()) if (shared / "state.json").exists() else {}
    dirs = [Path(d) for d in st.get("tasks", {}).get("heldout", [])]
    if not dirs or not all((d / "task.toml").exists() for d in dirs):
        return None
    return {d.name: task_io.load_task(str(d)).n_assertions for d in dirs}


def verdict(diff: float, paper_sign: int, p: float) -> str:
    """The paper's direction and p < 0.05: agrees; the opposite direction and p < 0.05: disagrees; else n.s."""
    if diff == 0 or math.isnan(diff):
        return "no difference"
    if (diff > 0) != (paper_sign > 0):
        return "disagrees" if p < 0.05 else "opposite sign, n.s."
    return "agrees" if p < 0.05 else "same sign, n.s."


def seed_verdict(c: dict, paper_sign: int = +1) -> str:
    """verdict() of a contrast, said to hold for these seeds' checkpoints only where the t interval of the seeds'
    differences reaches 0 (or there is one seed): the test does not see another seed's."""
    v = verdict(c["diff"], paper_sign, c["p"])
    if v not in ("agrees", "disagrees"):
        return v
    _, lo, hi = t_interval(c["per_seed"])
    if math.isnan(lo):
        return f"{v} (one seed)"
    return v if lo > 0 or hi < 0 else f"{v} (these seeds; the interval over seeds reaches 0)"


def rl_vs_sft_rows(out: Path, ppo: list) -> list:
    """The claim RL > SFT, one row per test split: every ppo seed against its own seed's SFT evaluation (split test:
    the summaries'; the other splits: the evals/ files), seed-blocked."""
    splits = sorted({sp for d in shared_runs(out) for sp, _ in eval_files(d)} - {"test", "val"})
    rows = []
    for split in ["test", *splits]:
        got = [(r, (sft_eval(r), r["summary"]["eval_rl"]) if split == "test" else split_evals(r, split)) for r in ppo]
        missing = [f"{r['dir'].name} ({'SFT' if e[0] is None else 'RL'})" for r, e in got if None in e]
        c = {} if missing else contrast([(r["sft"].name, a, b) for r, (a, b) in got])
        rows.append(f"| RL beats SFT on {split} | {SPLIT_NAMES.get(split, split)} | 49.4 -> 64.0 (Terminal-Bench "
                    f"2.1) | " + (f"{said(c, 'SFT', 'RL')} | {seed_verdict(c)} |" if c else
                                  (f"no evaluation of this split: {', '.join(missing)}" if missing else
                                   "no per-trial rows" if ppo else "the ppo arm not run") + " | - |"))
    best = [(r["sft"].name, sft_eval(r), r["summary"].get("eval_rl_best_val")) for r in ppo]
    c = contrast(best) if ppo and all(b for _, _, b in best) else {}
    if c:
        rows.append(f"| RL beats SFT on test, at the step validation chose | {SPLIT_NAMES['test']} | 49.4 -> 64.0 | "
                    f"{said(c, 'SFT', 'RL')} | {seed_verdict(c)} |")
    return rows


def report(out: Path) -> str:
    """The claims table (markdown) and the three pictures, from the run directories under out."""
    sh = shared_runs(out)
    if not sh or not all((d / "summary.json").is_file() for d in sh):
        raise FileNotFoundError(f"{out / 'shared' / 'summary.json'}: no finished shared run under {out} ("
                                f"`python -m experiments.paper run --out {out}` makes one)")
    arms = collect(out)
    shared = [json.loads((d / "summary.json").read_text()) for d in sh]
    lines = [f"### The paper's claims in miniature ({out}, {datetime.date.today()})", "",
             f"| arm | seeds | solve rate on {SPLIT_NAMES['test']} [95% CI] | mean reward | RL steps | "
             f"wall time / seed (s) |", "|---|---|---|---|---|---|"]
    for k in ("eval_base", "eval_sft"):
        es = [e[k] for e in shared if e.get(k) and e[k].get("n_trials")]
        if es:
            m, lo, hi = _interval(es)
            wall = np.mean([sum(e.get("phase_times", {}).values()) for e in shared]) if k == "eval_sft" else None
            lines.append(f"| {k[5:].upper()} ({'shared' if len(sh) == 1 else 'per seed'}) | "
                         f"{'-' if len(sh) == 1 else len(es)} | {m:.3f} [{lo:.3f}, {hi:.3f}] | "
                         f"{np.mean([e['reward_mean'] for e in es]):.3f} | 0 | "
                         f"{'-' if wall is None else f'{wall:.0f}'} |")
    for arm, runs in arms.items():
        m, lo, hi = _interval([r["summary"]["eval_rl"] for r in runs])
        rw = np.mean([r["summary"]["eval_rl"]["reward_mean"] for r in runs])
        each = "" if len(runs) < 2 else "; per seed " + ", ".join(f"{r['summary']['eval_rl']['solve_rate']:.3f}"
                                                               for r in runs)
        lines.append(f"| {arm} | {len(runs)} | {m:.3f} [{lo:.3f}, {hi:.3f}]{each} | {rw:.3f} | "
                     f"{runs[0]['summary']['rl_steps']} | {np.mean([r['wall_s'] for r in runs]):.0f} |")
        best = [r["summary"].get("eval_rl_best_val") for r in runs]
        if all(best):  # --n-val-tasks: held-out at the step each seed's validation set chose
            m, lo, hi = _interval(best)
            lines.append(f"| {arm}@val | {len(runs)} | {m:.3f} [{lo:.3f}, {hi:.3f}] | "
                         f"{np.mean([b['reward_mean'] for b in best]):.3f} | {', '.join(str(b['step']) for b in best)} "
                         f"(chosen) | - |")
    n = (shared[0].get("eval_sft") or {}).get("n_trials", 0)
    tito_res = json.loads((out / "tito.json").read_text()) if (out / "tito.json").exists() else None  # tito_step's
    walls = dict(shared=sum(sum(e.get("phase_times", {}).values()) for e in shared),
                 arms=sum(r["wall_s"] for runs in arms.values() for r in runs),
                 tito=(tito_res or {}).get("wall_s", 0.0))
    lines += ["", f"Time: {sum(walls.values()) / 60:.0f} min of phases in all (shared run{'s' * (len(sh) > 1)} "
              f"{walls['shared'] / 60:.0f}, {sum(len(r) for r in arms.values())} arm runs {walls['arms'] / 60:.0f}, "
              f"TITO measurement {walls['tito'] / 60:.0f}; process start-up and checkpoint copies not counted).", "",
              f"Split test: {n} trials an evaluation, " + ("the same tasks and one SFT model for every arm and seed"
                                                           if len(sh) == 1 else "each seed its own tasks and SFT "
                                                           "model, shared by its arms") + ". Claims (ours vs the "
              "paper's): tests are seed-blocked sign-flip permutations of the tasks' paired differences (attempts "
              "averaged; experiments/seeds.py), two-sided; a row without a test reports its spread over seeds and "
              "no verdict.", "", "| claim | split | paper | ours | verdict |", "|---|---|---|---|---|"]
    ppo, test = arms.get("ppo", []), SPLIT_NAMES["test"]

    def arm_vs_ppo(arm, paper, label, hard=None, note=""):  # the paper: ppo above the arm; hard: {seed: its slice}
        by, hard = {r["seed"]: r for r in arms.get(arm, [])}, hard or {}
        c = contrast([(r["seed"], only(by[r["seed"]]["summary"]["eval_rl"], hard.get(r["seed"])),
                       only(r["summary"]["eval_rl"], hard.get(r["seed"]))) for r in ppo if r["seed"] in by])
        ours = f"{note}{said(c, arm, 'ppo')} | {seed_verdict(c)} |" if c else "not run | - |"
        lines.append(f"| {label} | {test} | {paper} | {ours}")
    lines += rl_vs_sft_rows(out, ppo)
    arm_vs_ppo("binary", "dense 64.0 vs binary 47.2", "dense reward beats binary")
    counts = {r["seed"]: assertion_counts(r["sft"]) for r in ppo if arms.get("binary")}
    label = f"dense beats binary on the hard slice (>= {HARD_MIN} assertions)"
    if None in counts.values():
        lines.append(f"| {label} | {test} | dense 64.0 vs binary 47.2 | the held-out task directories are not found "
                     f"from here | - |")
    elif counts:
        hard = {s: {k for k, v in cs.items() if v is not None and v >= HARD_MIN} for s, cs in counts.items()}
        if any(hard.values()):
            nh, nt = ("/".join(sorted({str(len(x)) for x in d.values()})) for d in (hard, counts))
            arm_vs_ppo("binary", "dense 64.0 vs binary 47.2", label, hard,
                       f"{nh} of {nt} held-out tasks{' per seed' * (len(counts) > 1)}: ")
        else:
            most = max((v for cs in counts.values() for v in cs.values() if v is not None), default=0)
            lines.append(f"| {label} | {test} | dense 64.0 vs binary 47.2 | none of the "
                         f"{sum(map(len, counts.values()))} held-out tasks has >= {HARD_MIN} assertions (most: "
                         f"{most}) | - |")
    arm_vs_ppo("grpo", "PPO 64.0 vs GRPO 51.7", "PPO with a critic beats GRPO")
    fails = [r.get("all_fail_group_frac") for run in arms.get("grpo", []) for r in run["rl"]]
    fails = [f for f in fails if f is not None]
    if fails:
        lines.append(f"| GRPO: groups where every sample failed | RL pool | (the paper's reason) | {np.mean(fails):.2f}"
                     f" of groups per step | - |")
    for arm, label in (("ppo", "warm"), ("cold", "cold (zero head)"), ("cold_default", "cold (random head)")):
        ev = [r.get("explained_variance") for run in arms.get(arm, []) for r in run["rl"]]
        ev = [e for e in ev if e is not None and not math.isnan(e)]
        if ev:
            paper = "EV 0.71-0.86" if arm == "ppo" else "EV from -33.6, 30 of 58 steps < 0"
            tr = [[r.get("explained_variance_traj", float("nan")) for r in run["rl"][:4]] for run in arms[arm]]
            tr = [e for run in tr for e in run if not math.isnan(e)]  # one point per trajectory, first 4 steps
            lines.append(f"| critic EV per update, {label} start | RL pool | {paper} | {min(ev):.2f} .. {max(ev):.2f}, "
                         f"first {ev[0]:.2f}, {sum(e < 0 for e in ev)} of {len(ev)} updates < 0" +
                         (f"; per trajectory over the first 4 steps {min(tr):.2f} .. {max(tr):.2f}" if tr else "") +
                         " | - |")
    arm_vs_ppo("cold", "warm-up helps", "Critic Warm-Up helps held-out (vs a zero head)")
    arm_vs_ppo("cold_default", "warm-up helps", "Critic Warm-Up helps held-out (vs a random head)")
    r3 = []  # per ppo seed: mean abs(dlogp) R3 off, on, over the steps that ran the diagnostic (--r3-off-every K)
    for run in ppo:
        pair = [r for r in run["rl"] if math.isfinite(r.get("dlogp_r3_off", float("nan")))]
        if pair:
            r3.append((float(np.mean([r["dlogp_r3_off"] for r in pair])), float(np.mean([r["dlogp"] for r in pair]))))
    if r3:
        spread = "" if len(r3) < 2 else f"; off - on per seed {', '.join(f'{x - y:+.4f}' for x, y in r3)}"
        lines.append(f"| R3 cuts abs(dlogp) | RL pool | 0.021 -> 0.013 | {np.mean([x for x, _ in r3]):.4f} -> "
                     f"{np.mean([y for _, y in r3]):.4f} (same batches, R3 off / on; {len(r3)} seed(s){spread}) | "
                     f"- (measured, no test) |")
    rows = [r for run in ppo for r in run["rl"]]
    if rows:
        drift = np.mean([r.get("tito_drift_pct", float("nan")) for r in rows])
        lines.append(f"| TITO: loss-region drift | RL pool | 0.0000% | {drift:.4f}% | - |")
    arm_vs_ppo("r3off", "R3 stabilises training", "R3 on beats R3 off on held-out")
    if tito_res is not None:
        t = tito_res
        (nv, tt), (rn, rt) = ((t[k]["naive"], t[k]["tito"]) for k in ("sft", "random"))
        lines.append(f"| TITO vs naive re-tokenisation: loss-region drift | bench tito's tasks | TITO 0.0000% (naive: "
                     f"paper silent) | the SFT model at T = 1: naive {nv['loss_region_drift_pct']:.4f}% vs TITO "
                     f"{tt['loss_region_drift_pct']:.4f}% ({tt['turns']} turns of {t['sft']['tasks']} tasks through "
                     f"the gateway; TITO's boundary cases {', '.join(f'{k} {v}' for k, v in tt['cases'].items())}); "
                     f"a random-init model: naive {rn['loss_region_drift_pct']:.4f}% vs TITO "
                     f"{rt['loss_region_drift_pct']:.4f}% | - (one measurement, no test) |")
    else:
        lines.append("| TITO vs naive re-tokenisation: loss-region drift | bench tito's tasks | TITO 0.0000% | not run "
                     "(or failed: tito-work/*.stderr.log) | - |")
    unfinished = sorted(d.name for d in out.glob("*-s*") if (d / "state.json").exists()
                        and not (d / "summary.json").exists() and not d.name.startswith("shared"))
    if unfinished:
        lines += ["", f"Failed or unfinished arm runs (not in the table; their stdout.log): {', '.join(unfinished)}"]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    plots(out, arms)
    return text


def plots(out: Path, arms: dict) -> None:
    """reward.png (training reward r = P / S per arm, the binary arm's too: reward_dense_mean; runs before it was
    logged plot reward_mean), ev.png (EV per update, warm vs cold), dlogp.png (R3 on vs off)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(ax, runs, key, label):
        def finite(r):  # a step without the value (None, or NaN: the R3-off diagnostic every K steps) is left out
            return r.get(key) is not None and math.isfinite(r[key])
        steps = sorted({r["step"] for run in runs for r in run["rl"] if finite(r)})
        ys = [np.mean([r[key] for run in runs for r in run["rl"] if r["step"] == s and finite(r)]) for s in steps]
        ax.plot(steps, ys, marker=".", label=label)
    for name, keys in (("reward", [(a, "reward_dense_mean" if any("reward_dense_mean" in r for run in arms[a]
                                                               for r in run["rl"]) else "reward_mean", a)
                                   for a in arms]),
                       ("ev", [(a, k, f"{a}{t}") for a in ("ppo", "cold", "cold_default") if a in arms
                               for k, t in (("explained_variance", ""), ("explained_variance_traj", " per trajectory"))
                               if any(r.get(k) is not None for run in arms[a] for r in run["rl"])]),
                       ("dlogp", [("ppo", "dlogp", "R3 on"), ("ppo", "dlogp_r3_off", "R3 off")] if "ppo" in arms
                        else [])):
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm, key, label in keys:
            curve(ax, arms[arm], key, label)
        ax.set_xlabel("RL step")
        ax.set_title({"reward": "training reward r = P / S per arm", "ev": "critic EV: warm vs cold",
                      "dlogp": "abs(dlogp) of the ppo arm: R3 on vs off"}[name])
        if keys:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=80)
        plt.close(fig)
