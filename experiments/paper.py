"""The paper's comparisons in miniature (the paper's ablations): every arm's RL phase from one shared SFT checkpoint
and warmed critic, then one report with the paper's figure beside ours (experiments/claims.py: the table, its
tests and pictures).

    bash run.sh paper [--quick] [--seeds 3] [--arms ppo binary grpo cold cold_default r3off] [-- train_t1 flags]
    python -m experiments.paper run --out runs/paper [--quick | --full] [--seeds N] [--seed S] [--rl-steps N]
                                    [--sft-per-seed] [--results FILE] [-- train_t1 flags]
    python -m experiments.paper report runs/paper    # the report again from the run directories

OUT/shared is a train_t1.py run with --rl-steps 0 (tasks, base phase, SFT, the base and SFT evaluations, the critic
warm-up). Each arm x seed is its own train_t1.py run directory OUT/<arm>-s<seed>, started from a copy of the shared
state (the same tasks and S, the base and SFT checkpoints and evaluations, and the warmed critic, except for the cold
arm, which has none, and the binary arm, which warms its critic on its own reward), so that arms differ only in their
RL phase and are evaluated on the same held-out tasks. --sft-per-seed: a shared run per seed instead, OUT/shared-s<s>
(its own tasks, base and SFT), which arm seed s starts from. Every arm runs in its
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
vs binary claim is also tested on the hard slice (held-out tasks with >= claims.HARD_MIN assertions, where full
solves are rare; the table says so when the pool has none).

Every arm runs the preset's RL settings: with --full that is rollouts at T = 0.7 and a KL of 0.05 to SFT
(train_t1.FULL, not the paper's T = 1 without KL), the same for every arm. With --n-val-tasks N passed to train_t1,
each arm also gets a row "<arm>@val": held-out at the RL step its validation set chose (report.best_val), and RL@val
vs SFT a claim row; the arms' comparisons stay at their last step (the paper compares fixed step counts).

Choices where the paper is silent: arms run sequentially, seed by seed (every arm's seed 0, then every arm's seed 1,
...); the default is 3 seeds per arm; the interval of an arm is mean +- t * sd / sqrt(n) over its seeds, clipped to
[0, 1], or the Wilson interval of the seeds' trials pooled where that is wider (Wilson's alone for one seed);
every test is experiments/seeds.py's seed-blocked sign-flip permutation of the tasks' paired differences (pass@1
with the attempts averaged; two-sided here): an arm against ppo seed by seed, RL against its own seed's SFT (arms
from one shared SFT: that SFT counted once, never once per seed); "agrees" means the paper's sign at p < 0.05,
"disagrees" the opposite sign at p < 0.05 (either marked "(one seed)", or "(these seeds; ...)" where the t interval
of the seeds' differences reaches 0), "same sign, n.s." / "opposite sign, n.s." otherwise; rows with no test
(R3's dlogp, TITO's drift) give their spread over seeds and no verdict; each row names its split. The test holds
the trained models fixed: it does not see how much another seed would move an arm (the per-seed figures and the
interval do). --quick (the test's form): the quick preset, one seed, RL steps as the preset gives; its
report is written to OUT/report.md only (the real run also appends it to --results,
results/LOG.md by default: the dated log; RESULTS.md holds only the headline tables).
"""
import argparse
import datetime
import json
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
    r.add_argument("--sft-per-seed", action="store_true", help="a shared phase per seed (OUT/shared-s<s>: its own "
                   "tasks, base and SFT), so that RL vs SFT counts the SFT's seed variance too")
    r.add_argument("--results", default="results/LOG.md",
                   help="the dated log the report is appended to (not with --quick)")
    r.add_argument("rest", nargs=argparse.REMAINDER, help="-- then flags for every train_t1.py run")
    rp = sub.add_parser("report", help="the report from the run directories under OUT", formatter_class=fmt)
    rp.add_argument("out", help="the directory `run` wrote (its shared/ and <arm>-s<seed>/ runs)")
    return p


if __name__ == "__main__":
    ARGV = build_parser().parse_args()  # --help and bad flags answer here, before the project modules load

from experiments.claims import report, shared_runs  # noqa: E402
from rundir import write_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train_t1.py, engine/, ...

OWNED = {"--reward-mode", "--advantage", "--samples-per-task", "--critic-warmup-epochs", "--critic-head-init",
         "--r3-mode", "--rl-steps", "--seed", "--run-dir"}  # the flags experiments/paper.py sets: refused after --
OWN_WARMUP = ("cold", "cold_default", "binary")  # the cold ones: no warm-up (their flag); binary: on its own reward
SHARED_KEYS = ("tasks", "reward_scale", "base", "eval_base", "eval_sft", "eval_sft_splits", "eval_sft_train",
               "critic_warmup")


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


def shared_phase(shared: Path, preset: list, passthrough: list, seed: int | None) -> tuple:
    """A train_t1.py run with --rl-steps 0 in `shared` (tasks, base, SFT, their evaluations, the critic warm-up),
    kept when finished; -> (its state, its args). A finished one of another seed is refused (its arms would pair
    other tasks)."""
    own = ["--seed", str(seed)] if seed is not None else []
    if not (shared / "summary.json").exists():
        code = run_logged(train_cmd(preset, shared, ["--rl-steps", "0", *own, *passthrough]), shared, 0,
                          f"{shared.name}: SFT")
        if code:
            raise RuntimeError(f"the shared phase failed (exit {code}): {shared / 'stdout.log'}")
    args = json.loads((shared / "args.json").read_text())  # the shared run's: its rl_steps is 0, not the arms'
    if seed is not None and args["seed"] != seed:
        raise ValueError(f"--seed {seed}: the shared run in {shared} has seed {args['seed']} (its tasks and SFT); "
                         "pass that seed or another --out")
    return json.loads((shared / "state.json").read_text()), args


def run(out: Path, preset: list, arms: list, seeds: int, rl_steps: int | None, passthrough: list,
        seed: int | None = None, sft_per_seed: bool = False) -> dict:
    """The shared phase (train_t1's --seed `seed`: the tasks, base, SFT; the preset's when None), then every arm x
    seed (sequentially; arm seed s runs with the shared seed + s); sft_per_seed: a shared phase per seed instead,
    OUT/shared-s<s> with the seed + s (its own tasks, base and SFT), which arm seed s starts from; -> {name: exit
    code}."""
    if (out / "shared").exists() and sft_per_seed or not sft_per_seed and any(out.glob("shared-s*")):
        raise ValueError(f"{out}: its shared runs are {'one for all seeds' if sft_per_seed else 'one per seed'}: "
                         "pass the --sft-per-seed of the run that made them, or another --out")
    st, args = shared_phase(out / ("shared-s0" if sft_per_seed else "shared"), preset, passthrough, seed)
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
        shared = out / (f"shared-s{s}" if sft_per_seed else "shared")
        if sft_per_seed and s:
            shared_phase(shared, preset, passthrough, args["seed"] + s)
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
    for name, ckpt in (("sft", ["--ckpt", str(shared_runs(out)[0] / "ckpt" / "sft")]), ("random", [])):
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
    codes = run(out, preset, a.arms, seeds, a.rl_steps, rest, a.seed, a.sft_per_seed)
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
