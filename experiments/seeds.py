"""Seeds counted: the RL - SFT gain of independent pipeline seeds (each seed its own tasks, base, SFT and RL), each
seed's own figure and the pooled one, for every test split the runs evaluated; and the command that files one run's
evaluations under results/ with the commit (the run's where it records one, else HEAD at collect) and machine.

    python -m experiments.seeds report DIR [DIR ...] [--json FILE] [--n-perm N]
    python -m experiments.seeds collect RUN_DIR OUT_DIR [--replace]     # -> OUT_DIR/seed<N>/

DIR: a run directory (or a folder `collect` wrote) holding args.json (its "seed", "rl_steps") and the evaluations
runstate.eval_row writes, in DIR/evals/ (or in DIR itself), or a parent of several such folders. Evaluation files
(runstate.SPLITS): step_NNNNNN.json (split test, in-template), test_deep_step_NNNNNN.json (out-of-template: deeper
RST compositions), test_names_step_NNNNNN.json (unseen names), val_step_NNNNNN.json (validation), N the RL step whose
weights were scored (0: SFT); <split>_step_NNNNNN.json is read as that split too (test_step_... as test); a file's
own "split" and "after_step", where it records them, must agree with its name. The report shows every split except
val (the recipe's choices are made on val), and for each seed the SFT evaluation (step 0) against the final one
(args.json's rl_steps).

Statistics (the paper's protocol: pass@1 averaged over attempts, paired over tasks with the attempts averaged):
1. A task's score is the mean over its attempts of `resolved` (solve rate) or of `reward` (mean reward); a seed's
   figure is the mean over its tasks, its gain RL - SFT paired over the same tasks.
2. The interval: the mean of the seeds' gains +- t(0.975, n - 1) sd / sqrt(n) over the n seeds. It is the statement
   about run-to-run variance (another seed of the same recipe); one seed has none.
3. The test (`blocked_test`): a sign-flip permutation test stratified by seed. Within each seed, each task's paired
   difference keeps or flips its sign at random (RL and SFT swapped on that task), never across seeds; the statistic
   is the pooled gain itself (the mean over seeds of each seed's mean difference); one-sided p of RL > SFT =
   (1 + #{draws >= observed}) / (1 + draws). Chosen over a hierarchical bootstrap (seeds, then tasks) because with 3
   seeds a bootstrap over seeds sees only 10 distinct resamples and shrinks the between-seed variance by (n - 1) / n:
   it is anti-conservative exactly at the seed counts a 2-core machine affords, while the permutation test's
   false-positive rate is at most alpha by construction, whatever the tasks' difficulty and whatever the shape of the
   differences (tests/test_seeds.py measures both its calibration and its power). Its null holds each seed's two
   checkpoints fixed (in every seed, on every task, SFT and RL outcomes exchangeable): it does not see how much a
   new seed would move the gain; the interval of 2. does. A stratum with several RL evaluations against one SFT
   evaluation (experiments/claims.py: paper.py's arms from one shared SFT) permutes which of the k + 1 is SFT, task
   by task, so the shared SFT outcomes count once.
4. Each split ends with a reading of 2. and 3. together: a p < 0.05 whose interval reaches 0 holds for these
   seeds' checkpoints only. Each other test split's gain minus the in-template one's is given seed by seed with its
   t interval (no permutation test: the two splits score different tasks).
5. Errored trials count 0 (rollout.evaluate_trials); their count is printed beside every figure they enter.
Loud errors: a seed without the SFT or final evaluation of a split the report shows, two seeds with one seed value,
SFT and RL evaluations of a seed over different tasks, a file whose split or step disagrees with its name.
"""
import argparse
import datetime
import functools
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import report

ROOT = Path(__file__).resolve().parent.parent  # the repository root
EVAL_NAME = re.compile(r"^(?:(?P<split>[a-z][a-z0-9_]*)_)?step_(?P<step>\d+)\.json$")
SPLITS = ("test", "test_deep", "test_names")  # the report's order; other splits but val follow, sorted
SPLIT_NAMES = report.TITLES  # the splits' names, as the end-of-run table gives them
N_PERM = 10000  # sign-flip draws (the p-value's Monte Carlo error at p = 0.05: +- 0.002)
STATE_MAX_BYTES = 1 << 20  # collect copies state.json up to this size (the tasks' paths and the evaluations)


# --- the statistics --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def t_quantile(q: float, df: int) -> float:
    """Student's t quantile (q > 0.5) by bisection on its CDF, integrated with Simpson's rule (no scipy here)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x, n=2000):  # 0.5 + the integral of the density from 0 to x
        h = x / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


def t_interval(xs) -> tuple:
    """(mean, lo, hi): the 95% t interval of the mean of xs over its n values; NaN bounds for n < 2."""
    xs = np.asarray(xs, float)
    m = float(xs.mean())
    if len(xs) < 2:
        return m, float("nan"), float("nan")
    h = t_quantile(0.975, len(xs) - 1) * float(xs.std(ddof=1)) / math.sqrt(len(xs))
    return m, m - h, m + h


def blocked_test(strata: list, n_perm: int = N_PERM, seed: int = 0) -> dict:
    """The seed-blocked permutation test of b > a. strata: [(a, b)], one per seed, a the per-task scores (n_tasks,)
    of the baseline (SFT), b those of the compared evaluations (k, n_tasks) or (n_tasks,) over the same tasks in the
    same order. Per task the k + 1 scores are exchangeable under the null: a draw picks which of them is a (k = 1: a
    sign flip). Statistic: the mean over strata of mean_task(mean_k b - a). -> {stat, p_greater, p_less, n_strata,
    n_pairs}, the p-values one-sided, (1 + #{draws at least as extreme}) / (1 + n_perm)."""
    rng = np.random.default_rng(seed)
    obs, draws = 0.0, np.zeros(n_perm)
    for a, b in strata:
        vals = np.vstack([np.asarray(a, float)[None], np.atleast_2d(np.asarray(b, float))])  # (k + 1, n_tasks)
        k, n = vals.shape[0] - 1, vals.shape[1]
        if n == 0:
            raise ValueError("blocked_test: a stratum without tasks")
        total = vals.sum(0)  # (n_tasks,)
        obs += float(((total - (k + 1) * vals[0]) / k).mean())
        pick = vals[rng.integers(0, k + 1, size=(n_perm, n)), np.arange(n)]  # (n_perm, n_tasks): the drawn "a"
        draws += ((total - (k + 1) * pick) / k).mean(1)
    obs, draws = obs / len(strata), draws / len(strata)
    tol = 1e-12 * max(1.0, abs(obs))  # float ties count as at least as extreme
    return {"stat": obs, "p_greater": float((1 + np.sum(draws >= obs - tol)) / (1 + n_perm)),
            "p_less": float((1 + np.sum(draws <= obs + tol)) / (1 + n_perm)), "n_strata": len(strata),
            "n_pairs": int(sum(np.asarray(a).size for a, _ in strata))}


def per_task(ev: dict, key: str) -> dict:
    """{task: the mean of key ("resolved" or "reward") over its attempts} of one evaluation's trials."""
    acc = {}
    for t in ev["trials"]:
        acc.setdefault(t["task"], []).append(float(t[key]))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def paired_arrays(a: dict, b: dict, key: str, what: str) -> tuple:
    """Two evaluations' per-task scores over their (identical) task sets, sorted by task; else a loud error."""
    ta, tb = per_task(a, key), per_task(b, key)
    if set(ta) != set(tb):
        only_a, only_b = sorted(set(ta) - set(tb))[:3], sorted(set(tb) - set(ta))[:3]
        raise ValueError(f"{what}: the two evaluations cover different tasks ({len(ta)} vs {len(tb)}; only in the "
                         f"first: {only_a}, only in the second: {only_b})")
    keys = sorted(ta)
    return np.array([ta[k] for k in keys]), np.array([tb[k] for k in keys])


# --- the files ---------------------------------------------------------------------------------------------------
def eval_files(d: Path) -> dict:
    """{(split, step): path} of the evaluation files in d/evals (or in d itself when it has no evals/)."""
    where, out = (d / "evals" if (d / "evals").is_dir() else d), {}
    for f in sorted(where.glob("*.json")):
        m = EVAL_NAME.match(f.name)
        if not m:
            continue
        key = (m["split"] or "test", int(m["step"]))
        if key in out:
            raise ValueError(f"{f} and {out[key]}: two evaluation files of split {key[0]} at step {key[1]}")
        out[key] = f
    return out


def load_eval(path: Path, split: str, step: int) -> dict:
    """One evaluation file, checked: per-trial rows (task, attempt, resolved, reward), n_errors, n_trials, and its
    split / after_step, where it records them, those of its name."""
    ev = json.loads(Path(path).read_text())
    if not ev.get("trials") or any(k not in ev for k in ("n_errors", "n_trials")):
        raise ValueError(f"{path}: not an evaluation with per-trial rows (runstate.eval_row): no trials / n_errors")
    if ev.get("split", split) != split or ev.get("after_step", step) != step:
        raise ValueError(f"{path}: records split {ev.get('split')!r} after step {ev.get('after_step')}, its name "
                         f"says {split!r} step {step}")
    if len(ev["trials"]) != ev["n_trials"]:
        raise ValueError(f"{path}: {len(ev['trials'])} trial rows for n_trials = {ev['n_trials']}")
    return ev


def is_seed_dir(d: Path) -> bool:
    return (d / "args.json").is_file() and bool(eval_files(d))


def seed_dirs(dirs: list) -> list:
    """The seed folders named: each DIR itself, or its children that are seed folders (sorted)."""
    out = []
    for d in map(Path, dirs):
        if is_seed_dir(d):
            out.append(d)
            continue
        kids = sorted(c for c in d.iterdir() if c.is_dir() and is_seed_dir(c)) if d.is_dir() else []
        if not kids:
            raise ValueError(f"{d}: neither a run folder (args.json and evals/*step_*.json) nor a parent of any")
        out += kids
    return out


def load_seeds(dirs: list) -> list:
    """[{seed, dir, rl_steps, files}] of the seed folders under dirs; two with one seed value are an error."""
    seeds, seen = [], {}
    for d in seed_dirs(dirs):
        args = json.loads((d / "args.json").read_text())
        if "seed" not in args or "rl_steps" not in args:
            raise ValueError(f"{d / 'args.json'}: no seed / rl_steps")
        if args["seed"] in seen:
            raise ValueError(f"{seen[args['seed']]} and {d}: both seed {args['seed']} (one seed counted twice)")
        seen[args["seed"]] = d
        seeds.append({"seed": args["seed"], "dir": str(d), "rl_steps": int(args["rl_steps"]), "files": eval_files(d)})
    return seeds


# --- the report --------------------------------------------------------------------------------------------------
def split_table(seeds: list, split: str, n_perm: int = N_PERM) -> dict:
    """One split: each seed's SFT and final RL figures and gains, then the pooled ones (interval and test)."""
    rows, strata = [], {"resolved": [], "reward": []}
    for s in seeds:
        final = s["rl_steps"]
        need = {"SFT (step 0)": (split, 0), f"final RL (step {final})": (split, final)}
        missing = [w for w, k in need.items() if k not in s["files"]]
        if final < 1 or missing:
            raise ValueError(f"{s['dir']} (seed {s['seed']}): no {' and no '.join(missing) or 'RL step'} evaluation "
                             f"of split {split} (the report shows it: every seed needs both)")
        sft, rl = (load_eval(s["files"][(split, k)], split, k) for k in (0, final))
        row = {"seed": s["seed"], "dir": s["dir"], "rl_step": final, "attempts": [sft.get("attempts"),
               rl.get("attempts")], "n_errors": [sft["n_errors"], rl["n_errors"]],
               "n_trials": [sft["n_trials"], rl["n_trials"]]}
        for key, name in (("resolved", "solve"), ("reward", "reward")):
            a, b = paired_arrays(sft, rl, key, f"{s['dir']} split {split}, SFT vs step {final}")
            strata[key].append((a, b))
            t = blocked_test([(a, b)], n_perm)
            row.update({"n_tasks": len(a), f"sft_{name}": float(a.mean()), f"rl_{name}": float(b.mean()),
                        f"gain_{name}": float((b - a).mean()), f"p_{name}": t["p_greater"]})
        rows.append(row)
    pooled = {"n_seeds": len(rows), "n_errors": [sum(r["n_errors"][i] for r in rows) for i in (0, 1)],
              "n_trials": [sum(r["n_trials"][i] for r in rows) for i in (0, 1)]}
    for key, name in (("resolved", "solve"), ("reward", "reward")):
        m, lo, hi = t_interval([r[f"gain_{name}"] for r in rows])
        t = blocked_test(strata[key], n_perm)
        pooled.update({f"gain_{name}": m, f"gain_{name}_ci": [lo, hi], f"p_{name}": t["p_greater"],
                       f"sft_{name}": float(np.mean([r[f"sft_{name}"] for r in rows])),
                       f"rl_{name}": float(np.mean([r[f"rl_{name}"] for r in rows]))})
    return {"split": split, "name": SPLIT_NAMES.get(split, split), "seeds": rows, "pooled": pooled}


def transfer(tables: list) -> list:
    """Each other test split's gain minus the in-template one's, seed by seed (RL's gain carried beyond the training
    templates: at least as large is the paper's long-horizon claim), with the t interval over seeds. No permutation
    test: the two splits score different tasks, so no task pairs them."""
    base = next((t for t in tables if t["split"] == "test"), None)
    out = []
    for t in tables if base else []:
        if t["split"] == "test":
            continue
        g0, row = {r["seed"]: r for r in base["seeds"]}, {"split": t["split"], "name": t["name"]}
        for name in ("solve", "reward"):
            d = [r[f"gain_{name}"] - g0[r["seed"]][f"gain_{name}"] for r in t["seeds"]]
            m, lo, hi = t_interval(d)
            row[name] = {"per_seed": d, "mean": m, "ci": [lo, hi]}
        out.append(row)
    return out


def report(dirs: list, n_perm: int = N_PERM) -> dict:
    """{splits: [split_table of each test split any seed has], transfer} over the seed folders under dirs."""
    seeds = load_seeds(dirs)
    present = {sp for s in seeds for sp, _ in s["files"] if sp != "val"}
    order = [sp for sp in SPLITS if sp in present] + sorted(present - set(SPLITS))
    tables = [split_table(seeds, sp, n_perm) for sp in order]
    return {"dirs": [s["dir"] for s in seeds], "n_perm": n_perm,
            "test": "sign-flip permutation of per-task paired differences within each seed (one-sided, RL > SFT)",
            "interval": "95% t interval of the mean gain over seeds", "splits": tables, "transfer": transfer(tables)}


def _ci(lo, hi, n) -> str:
    return "(one seed: no interval over seeds)" if math.isnan(lo) else \
        f"[{lo:+.3f}, {hi:+.3f}] (95% t interval over seeds, n = {n})"


def reading(p: float, lo: float, hi: float, alpha: float = 0.05) -> str:
    """What the test and the interval over seeds say together (the test holds each seed's checkpoints fixed; the
    interval is the statement about another seed)."""
    if p >= alpha:
        return f"RL > SFT not shown (p >= {alpha})"
    if math.isnan(lo) or lo <= 0:
        return (f"RL > SFT on these seeds' checkpoints (p < {alpha}), not shown over seeds (" +
                ("one seed" if math.isnan(lo) else "the interval over seeds reaches 0") + ")")
    return f"RL > SFT: the test (p < {alpha}) and the interval over seeds (above 0) agree"


def format_report(rep: dict) -> str:
    """The report as markdown: per split, a row per seed, then the pooled lines."""
    out = []
    for t in rep["splits"]:
        p = t["pooled"]
        out += [f"### Split {t['name']}: {p['n_seeds']} seed{'s' * (p['n_seeds'] != 1)}, SFT (step 0) vs final RL",
                "",
                "| seed | tasks x attempts (SFT / RL) | SFT solve | RL solve | gain | p (this seed) | SFT reward | "
                "RL reward | gain | p (this seed) | errored trials SFT / RL | RL step | dir |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["seeds"]:
            out.append(f"| {r['seed']} | {r['n_tasks']} x {r['attempts'][0]} / {r['attempts'][1]} | "
                       f"{r['sft_solve']:.3f} | {r['rl_solve']:.3f} | {r['gain_solve']:+.3f} | {r['p_solve']:.3g} | "
                       f"{r['sft_reward']:.3f} | {r['rl_reward']:.3f} | {r['gain_reward']:+.3f} | "
                       f"{r['p_reward']:.3g} | {r['n_errors'][0]} of {r['n_trials'][0]} / {r['n_errors'][1]} of "
                       f"{r['n_trials'][1]} | {r['rl_step']} | {r['dir']} |")
        err = (f"errored trials (scored 0): SFT {p['n_errors'][0]} of {p['n_trials'][0]}, RL {p['n_errors'][1]} of "
               f"{p['n_trials'][1]}")
        for name, what in (("solve", "solve rate (pass@1, attempts averaged per task)"), ("reward", "mean reward")):
            out.append(f"- pooled {what}: SFT {p[f'sft_{name}']:.3f} -> RL {p[f'rl_{name}']:.3f}, gain "
                       f"{p[f'gain_{name}']:+.3f} {_ci(*p[f'gain_{name}_ci'], p['n_seeds'])}; seed-blocked sign-flip "
                       f"test of RL > SFT ({rep['n_perm']} draws): "
                       f"p = {p[f'p_{name}']:.3g}; {err}")
        out += [f"- reading (solve rate): {reading(p['p_solve'], *p['gain_solve_ci'])}", ""]
    for t in rep.get("transfer", []):
        for name, what in (("solve", "solve rate"), ("reward", "mean reward")):
            x = t[name]
            out.append(f"- gain on {t['name']} minus gain on {SPLIT_NAMES['test']}, {what}: per seed "
                       f"{', '.join(f'{v:+.3f}' for v in x['per_seed'])}; mean {x['mean']:+.3f} "
                       f"{_ci(*x['ci'], len(x['per_seed']))} (no permutation test: the splits' tasks differ)")
    return "\n".join(out)


# --- collect -------------------------------------------------------------------------------------------------
def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def collect(run_dir: Path, out_dir: Path, replace: bool = False) -> Path:
    """Copies a run's evals/*.json, args.json and state.json (when under STATE_MAX_BYTES) into out_dir/seed<N>/ (the
    same layout: evals/ beside args.json) with provenance.json: the commit (the run's, where args or state record
    one, else this repository's HEAD, and which), whether the tree had changes, the host, its CPU count, the date,
    the command line where args or state record one."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not is_seed_dir(run_dir):
        raise ValueError(f"{run_dir}: not a run folder (args.json and evals/*step_*.json)")
    args = json.loads((run_dir / "args.json").read_text())
    dest = out_dir / f"seed{args['seed']}"
    if dest.exists():
        if not replace:
            raise FileExistsError(f"{dest} exists (another run of seed {args['seed']}?): --replace to overwrite")
        shutil.rmtree(dest)
    (dest / "evals").mkdir(parents=True)
    for f in eval_files(run_dir).values():
        shutil.copy2(f, dest / "evals" / f.name)
    shutil.copy2(run_dir / "args.json", dest / "args.json")
    state, st = run_dir / "state.json", {}
    if state.is_file() and state.stat().st_size <= STATE_MAX_BYTES:
        shutil.copy2(state, dest / "state.json")
        st = json.loads(state.read_text())
    command = next((src[k] for src in (args, st) for k in ("argv", "command", "cmdline") if src.get(k)), None)
    commit = next((src[k] for src in (args, st) for k in ("commit", "git_commit") if src.get(k)), None)
    prov = {"source": str(run_dir.resolve()), "commit": commit or _git("rev-parse", "HEAD"),
            "commit_from": "the run's own record" if commit else "this repository's HEAD when collected",
            "tree_changed": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "hostname": socket.gethostname(), "nproc": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "state_copied": (dest / "state.json").exists(), "collected_by": sys.argv}
    (dest / "provenance.json").write_text(json.dumps(prov, indent=1))
    return dest


def _nan_null(x):
    if isinstance(x, dict):
        return {k: _nan_null(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_null(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.seeds", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="per seed and pooled RL - SFT gains, every test split")
    r.add_argument("dirs", nargs="+", help="run folders (args.json + evals/) or parents of several")
    r.add_argument("--json", default=None, help="also write the table to this file")
    r.add_argument("--n-perm", type=int, default=N_PERM, help="sign-flip draws of the test")
    c = sub.add_parser("collect", help="a run's evaluations + provenance into OUT_DIR/seed<N>/")
    c.add_argument("run_dir")
    c.add_argument("out_dir")
    c.add_argument("--replace", action="store_true", help="overwrite an existing OUT_DIR/seed<N>/")
    a = p.parse_args(argv)
    try:
        if a.cmd == "collect":
            print(collect(Path(a.run_dir), Path(a.out_dir), a.replace))
            return
        rep = report(a.dirs, a.n_perm)
    except (ValueError, FileExistsError, OSError) as e:
        sys.exit(f"experiments/seeds.py {a.cmd}: {e}")
    print(format_report(rep))
    if a.json:  # NaN (no interval from one seed) as null: plain JSON
        Path(a.json).write_text(json.dumps(_nan_null(rep), indent=1, allow_nan=False))


if __name__ == "__main__":
    main()
