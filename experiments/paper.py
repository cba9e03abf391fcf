"""The paper's comparisons in miniature (the paper's ablations): every arm's RL phase from one shared SFT checkpoint
and warmed critic, then one report with the paper's figure beside ours.

    bash run.sh paper [--quick] [--seeds 3] [--arms ppo binary grpo cold cold_default r3off] [-- train_t1 flags]
    python -m experiments.paper run --out runs/paper [--quick | --full] [--seeds N] [--seed S] [--rl-steps N]
                                    [--results FILE] [-- train_t1 flags]
    python -m experiments.paper report runs/paper    # the report again from the run directories

OUT/shared is a train_t1.py run with --rl-steps 0 (tasks, base phase, SFT, the base and SFT evaluations, the critic
warm-up). Each arm x seed is its own train_t1.py run directory OUT/<arm>-s<seed>, started from a copy of the shared
state (the same tasks and S, the base and SFT checkpoints and evaluations, and the warmed critic, except for the cold
arm, which has none, and the binary arm, which warms its critic on its own reward), so that arms differ only in their
RL phase and are evaluated on the same held-out tasks: paired tests over tasks (McNemar on the discordant tasks
pooled over seeds; train_t1's bootstrap for the mean reward) beside the interval over seeds. Every arm runs in its
own process, one after the other (2 cores): a crash fails that arm and is reported, the others go on; after a kill
the same command resumes (a finished arm, one with summary.json, is kept; an unfinished one resumes from its last
checkpoint).

Arms (ARMS; the flags they add to the shared preset):
  ppo    the paper's method: dense r = P / S, GAE with the full critic, warm-up, R3 replay
  binary --reward-mode binary: 1 if every test passed (the paper: 64.0 dense vs 47.2 binary)
  grpo   --advantage grpo --samples-per-task 4 (2 in --quick): the same trajectories per step over a quarter of the
         tasks, no critic (the paper: 64.0 vs 51.7); the fraction of all-fail groups per step is reported
  cold   --critic-warmup-epochs 0: the critic starts from the SFT backbone and a zero head, which predicts 0 (the
         paper: EV from -33.6, 30 of 58 steps negative, against 0.71-0.86 warmed)
  cold_default  the same with --critic-head-init default: a randomly initialised head, the miscalibrated cold critic
  r3off  --r3-mode off: the trainer routes live (the mismatch R3 removes: |dlogp| and whether training suffers)

After the arms, TITO vs naive re-tokenisation (tito_step: `python -m experiments.bench tito`, with the shared SFT
model sampling, and with a random-init model whose token sequences are not canonical) fills the TITO row; the dense
vs binary claim is also tested on the hard slice (held-out tasks with >= HARD_MIN assertions, where full solves are
rare; the table says so when the pool has none).

Every arm runs the preset's RL settings: with --full that is rollouts at T = 0.7 and a KL of 0.05 to SFT
(train_t1.FULL, not the paper's T = 1 without KL), the same for every arm. With --n-val-tasks N passed to train_t1,
each arm also gets a row "<arm>@val": held-out at the RL step its validation set chose (report.best_val), and RL@val
vs SFT a claim row; the arms' comparisons stay at their last step (the paper compares fixed step counts).

Choices where the paper is silent: arms run sequentially, seed by seed (every arm's seed 0, then every arm's seed 1,
...); the default is 3 seeds per arm; the interval of an arm is mean +- t * sd / sqrt(n) over its seeds, clipped to
[0, 1], or the Wilson interval of the seeds' trials pooled where that is wider (Wilson's alone for one seed);
"agrees" in the table means the difference has the paper's sign and the paired test gives p < 0.05, "disagrees" the
opposite sign at p < 0.05, "same sign, n.s." / "opposite sign, n.s." otherwise. The paired test holds the two
trained models fixed: it does not see how much another RL seed would move an arm, so one seed's verdicts are not the
paper's claims tested. --quick (the test's form): the quick preset, one seed, RL steps as the preset gives; its
report is written to OUT/report.md only (the real run also appends it to --results,
results/LOG.md by default: the dated log; RESULTS.md holds only the headline tables).
"""
import argparse
import datetime
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ARMS = {"ppo": [], "binary": ["--reward-mode", "binary"], "grpo": ["--advantage", "grpo", "--samples-per-task", "G"],
        "cold": ["--critic-warmup-epochs", "0"],
        "cold_default": ["--critic-warmup-epochs", "0", "--critic-head-init", "default"],
        "r3off": ["--r3-mode", "off"]}  # G: 4, or 2 when 4 does not divide the preset's --n-launch (the quick one's 10)


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: --help and bad flags answer before the project modules load)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="python -m experiments.paper", description=__doc__.split("\n\n")[0],
                                formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the shared phase, every arm x seed, then the report", formatter_class=fmt)
    r.add_argument("--out", default=None, help="the experiment's directory (default: %(default)s, which is "
                   "runs/paper, or runs/paper-quick with --quick)")
    r.add_argument("--quick", action="store_true", help="the quick preset, one seed: a smoke run (the test's form)")
    r.add_argument("--full", action="store_true",
                   help="the full preset (150 held-out tasks, 48 RL steps an arm: ~1 h per arm x seed; --rl-steps N)")
    r.add_argument("--seeds", type=int, default=None,
                   help="seeds per arm (default: %(default)s, which is 3, or 1 with --quick)")
    r.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="the arms to run")
    r.add_argument("--rl-steps", type=int, default=None, help="RL steps per arm (default: %(default)s, the preset's)")
    r.add_argument("--seed", type=int, default=None, help="the shared run's seed (tasks, base, SFT); arm seed s runs "
                   "with it + s (default: %(default)s, the preset's)")
    r.add_argument("--results", default="results/LOG.md",
                   help="the dated log the report is appended to (not with --quick)")
    r.add_argument("rest", nargs=argparse.REMAINDER, help="-- then flags for every train_t1.py run")
    rp = sub.add_parser("report", help="the report from the run directories under OUT", formatter_class=fmt)
    rp.add_argument("out", help="the directory `run` wrote (its shared/ and <arm>-s<seed>/ runs)")
    return p


if __name__ == "__main__":
    ARGV = build_parser().parse_args()  # --help and bad flags answer here, before the project modules load

import numpy as np  # noqa: E402

from report import mcnemar_p, paired, wilson  # noqa: E402
from sandbox import task_io  # noqa: E402
from rundir import write_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train_t1.py, engine/, ...

OWNED = {"--reward-mode", "--advantage", "--samples-per-task", "--critic-warmup-epochs", "--critic-head-init",
         "--r3-mode", "--rl-steps", "--seed", "--run-dir"}  # the flags experiments/paper.py sets: refused after --
OWN_WARMUP = ("cold", "cold_default", "binary")  # the cold ones: no warm-up (their flag); binary: on its own reward
SHARED_KEYS = ("tasks", "reward_scale", "base", "eval_base", "eval_sft", "eval_sft_train", "critic_warmup")
HARD_MIN = 8  # the hard slice: held-out tasks with >= 8 assertions, where full solves are rare (dense reward's case)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t quantiles


def train_cmd(preset: list, run_dir: Path, extra: list) -> list:
    return [sys.executable, str(ROOT / "train_t1.py"), *preset, "--run-dir", str(run_dir), *extra]


def run_logged(cmd: list, run_dir: Path, total_steps: int, desc: str) -> int:
    """One train_t1.py process, its output to run_dir/stdout.log, a progress bar fed by its state.json's step."""
    from tqdm import tqdm
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "stdout.log", "a") as out, tqdm(total=max(total_steps, 1), desc=desc) as bar:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(2)
            try:
                bar.n = json.loads((run_dir / "state.json").read_text()).get("step", 0)
                bar.refresh()
            except (OSError, ValueError):
                pass
    return proc.returncode


def preset_steps(preset: list, passthrough: list) -> int:
    """The RL steps of the preset an arm runs (train_t1.parse_args of the same flags, in a subprocess, as the arms
    themselves run)."""
    code = "import sys, train_t1; print(train_t1.parse_args(sys.argv[1:]).rl_steps)"
    proc = subprocess.run([sys.executable, "-c", code, *preset, *passthrough], capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode:
        raise ValueError(f"train_t1.py refused the flags {preset + passthrough}: {proc.stderr.strip()[-500:]}")
    return int(proc.stdout.split()[-1])


def seed_arm(shared: Path, arm_dir: Path, arm: str) -> None:
    """A new arm run directory from the shared one: its state (SHARED_KEYS, step 0), base / SFT checkpoints and the
    warmed critic, except for the arms that warm their own (OWN_WARMUP). An existing arm directory is left as it is
    (it resumes)."""
    if (arm_dir / "state.json").exists():
        return
    st = json.loads((shared / "state.json").read_text())
    missing = [k for k in ("tasks", "reward_scale", "eval_sft") if k not in st]
    if missing:
        raise ValueError(f"{shared}: the shared run lacks {missing}: it did not finish its SFT phase")
    own = arm in OWN_WARMUP
    state = {k: st[k] for k in SHARED_KEYS if k in st and not (own and k == "critic_warmup")}
    (arm_dir / "ckpt").mkdir(parents=True, exist_ok=True)
    for name in ("base", "sft"):
        if (shared / "ckpt" / name).exists():
            shutil.copytree(shared / "ckpt" / name, arm_dir / "ckpt" / name, dirs_exist_ok=True)  # over a killed copy
    if not own:
        if not (shared / "ckpt" / "critic_warm.pt").exists():
            raise ValueError(f"{shared}: no ckpt/critic_warm.pt (the shared run's critic warm-up) for arm {arm}: "
                             "the shared run must warm its critic (--critic-warmup-epochs >= 1)")
        shutil.copy2(shared / "ckpt" / "critic_warm.pt", arm_dir / "ckpt" / "critic_warm.pt")
    write_atomic(arm_dir / "state.json", json.dumps(dict(state, step=0, phase_times={}), indent=1))  # last: the mark


def run(out: Path, preset: list, arms: list, seeds: int, rl_steps: int | None, passthrough: list,
        seed: int | None = None) -> dict:
    """The shared phase (train_t1's --seed `seed`: the tasks, base, SFT; the preset's when None), then every arm x
    seed (sequentially; arm seed s runs with the shared seed + s); -> {name: exit code}."""
    shared = out / "shared"
    own = ["--seed", str(seed)] if seed is not None else []
    if not (shared / "summary.json").exists():
        code = run_logged(train_cmd(preset, shared, ["--rl-steps", "0", *own, *passthrough]), shared, 0,
                          "shared: SFT")
        if code:
            raise RuntimeError(f"the shared phase failed (exit {code}): {shared / 'stdout.log'}")
    st = json.loads((shared / "state.json").read_text())
    args = json.loads((shared / "args.json").read_text())  # the shared run's: its rl_steps is 0, not the arms'
    if seed is not None and args["seed"] != seed:
        raise ValueError(f"--seed {seed}: the shared run in {shared} has seed {args['seed']} (its tasks and SFT); "
                         "pass that seed or another --out")
    steps = preset_steps(preset, passthrough) if rl_steps is None else rl_steps
    if steps < 1:
        raise ValueError(f"the preset {preset} {passthrough} has rl_steps = {steps}: pass --rl-steps N (>= 1)")
    pt = st.get("phase_times", {})
    per_trial = pt.get("critic_warmup", 0.0) / max(args["critic_warmup_trials"], 1)
    est = steps * 2 * per_trial * args["n_keep"] + 2 * pt.get("eval_sft", 0.0)  # rollout + update, 2 evaluations
    print(f"[paper] {len(arms)} arms x {seeds} seeds, {steps} RL steps each; estimated {est / 60:.0f} min per arm "
          f"(from the shared run's warm-up and SFT evaluation), {len(arms) * seeds * est / 60:.0f} min in all",
          flush=True)
    codes = {}
    for s in range(seeds):  # seed-major: every arm has a seed before any has two (a run cut short covers them all)
        for arm in arms:
            name, d = f"{arm}-s{s}", out / f"{arm}-s{s}"
            if (d / "summary.json").exists() and json.loads((d / "summary.json").read_text())["rl_steps"] >= steps:
                codes[name] = 0
                continue
            seed_arm(shared, d, arm)
            flags = [("4" if args["n_launch"] % 4 == 0 else "2") if f == "G" else f for f in ARMS[arm]]
            codes[name] = run_logged(train_cmd(preset, d, ["--rl-steps", str(steps), "--seed", str(args["seed"] + s),
                                                          *flags, *passthrough]), d, steps, name)
            if codes[name]:
                print(f"[paper] arm {name} failed (exit {codes[name]}): {d / 'stdout.log'}", flush=True)
    codes["tito"] = tito_step(out, "--quick" in preset)
    return codes


def tito_step(out: Path, quick: bool) -> int:
    """TITO vs naive re-tokenisation (experiments/mechanisms.py tito_measure): the same tasks through the token
    gateway in naive and TITO mode, the loss-region drift of what each would train on, twice, at once (each its own
    process and engine; their output in OUT/tito-work/<name>.stdout.log, .stderr.log): the shared SFT model sampling
    (what the arms train) and a random-init tiny model (non-canonical token sequences, where naive mode drifts) ->
    OUT/tito.json (kept: a finished measurement is not redone). A failure is reported; the table says "not run"."""
    if (out / "tito.json").exists():
        return 0
    t0, work, procs = time.time(), out / "tito-work", {}
    work.mkdir(parents=True, exist_ok=True)
    for name, ckpt in (("sft", ["--ckpt", str(out / "shared" / "ckpt" / "sft")]), ("random", [])):
        cmd = [sys.executable, "-m", "experiments.bench", "tito", *(["--quick"] if quick else []),
               *ckpt, "--work-dir", str(work / name)]
        print(f"[paper] TITO vs naive re-tokenisation through the gateway (bench tito, {name} model)", flush=True)
        with open(work / f"{name}.stdout.log", "w") as so, open(work / f"{name}.stderr.log", "w") as se:
            procs[name] = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, cwd=ROOT)
    res, code = {}, 0
    for name, proc in procs.items():
        rc = proc.wait()
        lines = [ln for ln in (work / f"{name}.stdout.log").read_text().splitlines() if ln.startswith("{")]
        if rc or not lines:
            print(f"[paper] bench tito failed (exit {rc}): {work / name}.stderr.log", flush=True)
            code = code or rc or 1
        else:
            res[name] = json.loads(lines[-1])
    if code:
        return code
    write_atomic(out / "tito.json", json.dumps(dict(res, wall_s=time.time() - t0), indent=1))
    return 0


# --- the report --------------------------------------------------------------------------------------------
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
        h = T_975.get(len(xs) - 1, 1.96) * float(np.std(xs, ddof=1)) / math.sqrt(len(xs))
        lo, hi = np.nanmin([lo, max(m - h, 0.0)]), np.nanmax([hi, min(m + h, 1.0)])
    return m, float(lo), float(hi)


def _metrics(d: Path) -> list:
    p = d / "metrics.jsonl"
    return [r for r in (json.loads(l) for l in open(p)) if r["phase"] == "rl"] if p.exists() else []


def collect(out: Path) -> dict:
    """Every finished arm run under out: {arm: [{seed, summary, rl metrics rows, wall_s}]}."""
    arms = {}
    for d in sorted(out.glob("*-s*")):
        arm, _, seed = d.name.rpartition("-s")
        if arm not in ARMS or not (d / "summary.json").exists():
            continue
        sm = json.loads((d / "summary.json").read_text())
        arms.setdefault(arm, []).append(dict(seed=int(seed), summary=sm, rl=_metrics(d),
                                             wall_s=sum(sm["phase_times"].values())))  # the arm's own phases
    return arms


def only(ev: dict, tasks: set | None) -> dict:
    """An evaluation restricted to the trials of `tasks` (None: all)."""
    return ev if tasks is None else dict(ev, trials=[t for t in ev.get("trials", []) if t["task"] in tasks])


def pooled(pairs: list, tasks: set | None = None) -> dict:
    """[(evaluation a, evaluation b)] over the same held-out tasks -> b vs a: solved gained / lost pooled over the
    pairs, exact McNemar on the pooled discordant tasks, the mean reward difference; {} without per-trial rows.
    tasks: only these held-out tasks (the hard slice)."""
    pairs = [(only(x, tasks), only(y, tasks)) for x, y in pairs]
    ts = [paired(x, y) for x, y in pairs if x.get("trials") and y.get("trials")]
    if not ts:
        return {}
    g, l = sum(t["solved_gained"] for t in ts), sum(t["solved_lost"] for t in ts)
    return dict(gained=g, lost=l, mcnemar_p=mcnemar_p(g, l),
                reward_diff=float(np.mean([t["reward_diff"] for t in ts])), n_pairs=len(ts))


def compare(a: list, b: list, tasks: set | None = None) -> dict:
    """Arm b vs arm a over the seeds both have (paired over the same held-out tasks): pooled()."""
    by = {r["seed"]: r for r in a}
    return pooled([(by[r["seed"]]["summary"]["eval_rl"], r["summary"]["eval_rl"]) for r in b if r["seed"] in by],
                  tasks)


def assertion_counts(out: Path) -> dict | None:
    """{held-out task name: its assertion count} from the shared run's task directories (paths as the run wrote
    them, relative to where it ran); None when they are not found from here."""
    st = json.loads((out / "shared" / "state.json").read_text()) if (out / "shared" / "state.json").exists() else {}
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


def report(out: Path) -> str:
    """The claims table (markdown) and the three pictures, from the run directories under out."""
    if not (out / "shared" / "summary.json").is_file():
        raise FileNotFoundError(f"{out / 'shared' / 'summary.json'}: no finished shared run under {out} ("
                                f"`python -m experiments.paper run --out {out}` makes one)")
    arms = collect(out)
    shared = json.loads((out / "shared" / "summary.json").read_text())
    lines = [f"### The paper's claims in miniature ({out}, {datetime.date.today()})", "",
             "| arm | seeds | held-out solve rate [95% CI] | mean reward | RL steps | wall time / seed (s) |",
             "|---|---|---|---|---|---|"]
    for k in ("eval_base", "eval_sft"):
        e = shared.get(k)
        if e and e.get("n_trials"):
            m, lo, hi = _interval([e])
            wall = sum(shared["phase_times"].values()) if k == "eval_sft" else "-"  # the whole shared run
            lines.append(f"| {k[5:].upper()} (shared) | - | {m:.3f} [{lo:.3f}, {hi:.3f}] | {e['reward_mean']:.3f} | 0 "
                         f"| {wall if isinstance(wall, str) else f'{wall:.0f}'} |")
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
    n = (shared.get("eval_sft") or {}).get("n_trials", 0)
    tito_res = json.loads((out / "tito.json").read_text()) if (out / "tito.json").exists() else None  # tito_step's
    walls = dict(shared=sum(shared.get("phase_times", {}).values()),
                 arms=sum(r["wall_s"] for runs in arms.values() for r in runs),
                 tito=(tito_res or {}).get("wall_s", 0.0))
    lines += ["", f"Time: {sum(walls.values()) / 60:.0f} min of phases in all (shared run {walls['shared'] / 60:.0f}, "
              f"{sum(len(r) for r in arms.values())} arm runs {walls['arms'] / 60:.0f}, TITO measurement "
              f"{walls['tito'] / 60:.0f}; process start-up and checkpoint copies not counted).",
              "", f"Held-out tasks: {n} (the same for every arm). Claims (ours vs the paper's):", "",
              "| claim | paper | ours | verdict |", "|---|---|---|---|"]
    ppo = arms.get("ppo", [])

    def arm_vs_ppo(arm, paper, label):  # the paper: ppo above the arm
        c = compare(arms.get(arm, []), ppo)
        if not c:
            return lines.append(f"| {label} | {paper} | not run | - |")
        lines.append(f"| {label} | {paper} | ppo vs {arm}: solved +{c['gained']} -{c['lost']} over {c['n_pairs']} "
                     f"seed pairs, McNemar p = {c['mcnemar_p']:.3g}; mean reward {c['reward_diff']:+.3f} | "
                     f"{verdict(c['gained'] - c['lost'], +1, c['mcnemar_p'])} |")
    c = pooled([(shared.get("eval_sft") or {}, r["summary"]["eval_rl"]) for r in ppo])
    if c:
        lines.append(f"| RL beats SFT on held-out | 49.4 -> 64.0 | solved +{c['gained']} -{c['lost']} over "
                     f"{c['n_pairs']} seeds, McNemar p = {c['mcnemar_p']:.3g} | "
                     f"{verdict(c['gained'] - c['lost'], +1, c['mcnemar_p'])} |")
    best = [r["summary"].get("eval_rl_best_val") for r in ppo]
    c = pooled([(shared.get("eval_sft") or {}, b) for b in best]) if ppo and all(best) else {}
    if c:
        lines.append(f"| RL beats SFT on held-out, at the step validation chose | 49.4 -> 64.0 | solved "
                     f"+{c['gained']} -{c['lost']} over {c['n_pairs']} seeds, McNemar p = {c['mcnemar_p']:.3g} | "
                     f"{verdict(c['gained'] - c['lost'], +1, c['mcnemar_p'])} |")
    arm_vs_ppo("binary", "dense 64.0 vs binary 47.2", "dense reward beats binary")
    counts = assertion_counts(out)
    label = f"dense beats binary on the hard slice (>= {HARD_MIN} assertions)"
    if counts is None:
        lines.append(f"| {label} | dense 64.0 vs binary 47.2 | the held-out task directories are not found from "
                     f"here | - |")
    elif arms.get("binary") and ppo:
        hard = {k for k, v in counts.items() if v is not None and v >= HARD_MIN}
        c = compare(arms["binary"], ppo, hard) if hard else {}
        lines.append(f"| {label} | dense 64.0 vs binary 47.2 | " + (
            f"{len(hard)} of {len(counts)} held-out tasks: ppo vs binary solved +{c['gained']} -{c['lost']}, McNemar "
            f"p = {c['mcnemar_p']:.3g}; mean reward {c['reward_diff']:+.3f} | "
            f"{verdict(c['gained'] - c['lost'], +1, c['mcnemar_p'])} |" if c else
            f"none of the {len(counts)} held-out tasks has >= {HARD_MIN} assertions (most: "
            f"{max((v for v in counts.values() if v is not None), default=0)}) | - |"))
    arm_vs_ppo("grpo", "PPO 64.0 vs GRPO 51.7", "PPO with a critic beats GRPO")
    fails = [r.get("all_fail_group_frac") for run in arms.get("grpo", []) for r in run["rl"]]
    fails = [f for f in fails if f is not None]
    if fails:
        lines.append(f"| GRPO: groups where every sample failed | (the paper's reason) | {np.mean(fails):.2f} of "
                     f"groups per step | - |")
    for arm, label in (("ppo", "warm"), ("cold", "cold (zero head)"), ("cold_default", "cold (random head)")):
        ev = [r.get("explained_variance") for run in arms.get(arm, []) for r in run["rl"]]
        ev = [e for e in ev if e is not None and not math.isnan(e)]
        if ev:
            paper = "EV 0.71-0.86" if arm == "ppo" else "EV from -33.6, 30 of 58 steps < 0"
            tr = [[r.get("explained_variance_traj", float("nan")) for r in run["rl"][:4]] for run in arms[arm]]
            tr = [e for run in tr for e in run if not math.isnan(e)]  # one point per trajectory, first 4 steps
            lines.append(f"| critic EV per update, {label} start | {paper} | {min(ev):.2f} .. {max(ev):.2f}, first "
                         f"{ev[0]:.2f}, {sum(e < 0 for e in ev)} of {len(ev)} updates < 0" +
                         (f"; per trajectory over the first 4 steps {min(tr):.2f} .. {max(tr):.2f}" if tr else "") +
                         " | - |")
    arm_vs_ppo("cold", "warm-up helps", "Critic Warm-Up helps held-out (vs a zero head)")
    arm_vs_ppo("cold_default", "warm-up helps", "Critic Warm-Up helps held-out (vs a random head)")
    rows = [r for run in ppo for r in run["rl"]]
    pair = [r for r in rows if math.isfinite(r.get("dlogp_r3_off", float("nan")))]  # steps that ran the diagnostic
    if pair:  # (--r3-off-every K: one step in K), both means over the same steps
        on, off = np.mean([r["dlogp"] for r in pair]), np.mean([r["dlogp_r3_off"] for r in pair])
        lines.append(f"| R3 cuts abs(dlogp) | 0.021 -> 0.013 | {off:.4f} -> {on:.4f} (same batches, R3 off / on) | "
                     f"{verdict(off - on, +1, 0.0)} |")
    if rows:
        drift = np.mean([r.get("tito_drift_pct", float("nan")) for r in rows])
        lines.append(f"| TITO: loss-region drift | 0.0000% | {drift:.4f}% | - |")
    arm_vs_ppo("r3off", "R3 stabilises training", "R3 on beats R3 off on held-out")
    if tito_res is not None:
        t = tito_res
        (nv, tt), (rn, rt) = ((t[k]["naive"], t[k]["tito"]) for k in ("sft", "random"))
        lines.append(f"| TITO vs naive re-tokenisation: loss-region drift | TITO 0.0000% (naive: paper silent) | the "
                     f"SFT model at T = 1: naive {nv['loss_region_drift_pct']:.4f}% vs TITO "
                     f"{tt['loss_region_drift_pct']:.4f}% ({tt['turns']} turns of {t['sft']['tasks']} tasks through "
                     f"the gateway; TITO's boundary cases {', '.join(f'{k} {v}' for k, v in tt['cases'].items())}); "
                     f"a random-init model: naive {rn['loss_region_drift_pct']:.4f}% vs TITO "
                     f"{rt['loss_region_drift_pct']:.4f}% | "
                     f"{verdict(nv['loss_region_drift_pct'] - tt['loss_region_drift_pct'], +1, 0.0)} |")
    else:
        lines.append("| TITO vs naive re-tokenisation: loss-region drift | TITO 0.0000% | not run (or failed: "
                     "tito-work/*.stderr.log) | - |")
    unfinished = sorted(d.name for d in out.glob("*-s*") if (d / "state.json").exists()
                        and not (d / "summary.json").exists())
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


def add_log_entry(path: Path, title: str, text: str) -> None:
    """A dated entry in the log (results/LOG.md is newest first: it goes above the first entry, or at the end of a
    file that has none), written whole (write_atomic)."""
    old = path.read_text() if path.exists() else ""
    at = old.find("\n## ")
    entry = f"{title}\n\n{text.strip()}\n"
    if at < 0:
        write_atomic(path, old.rstrip() + "\n\n" + entry if old.strip() else entry)
    else:
        write_atomic(path, old[:at + 1] + entry + "\n" + old[at + 1:])


def main(argv=None) -> None:
    """Run one command: argv is a list of flags, or the parsed namespace."""
    p = build_parser()
    a = argv if isinstance(argv, argparse.Namespace) else p.parse_args(argv)
    if a.cmd == "report":
        try:
            print(report(Path(a.out)))
        except FileNotFoundError as e:
            sys.exit(f"experiments/paper.py report: {e}")
        return
    if a.quick and a.full:
        p.error("--quick and --full: pick one preset")
    preset = ["--quick"] if a.quick else ["--full"] if a.full else []
    out = Path(a.out or ("runs/paper-quick" if a.quick else "runs/paper"))
    seeds = a.seeds or (1 if a.quick else 3)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    if a.seeds is not None and a.seeds < 1 or a.rl_steps is not None and a.rl_steps < 1:
        p.error(f"--seeds {a.seeds} / --rl-steps {a.rl_steps}: each must be >= 1")
    owned = sorted({f.split("=")[0] for f in rest if f.split("=")[0] in OWNED})
    if owned:  # after the arm's flags they would win (argparse: the last one), every arm the same: no comparison
        p.error(f"flags after --: {owned} are set per arm or run (--arms, --seeds, --rl-steps, --out)")
    codes = run(out, preset, a.arms, seeds, a.rl_steps, rest, a.seed)
    text = report(out)
    print(text)
    if not a.quick and a.results:
        title = f"## {datetime.date.today()}: the paper's comparisons in miniature ({out})"
        add_log_entry(Path(a.results), title, text)
    failed = [k for k, c in codes.items() if c]
    if failed:
        sys.exit(f"[paper] arms that failed: {failed} (their stdout.log); the report holds the others")


if __name__ == "__main__":
    main(ARGV)
