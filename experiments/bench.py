"""The measurement commands: each prints the figures of one claim (one JSON line, or a table for cp).

    python -m experiments.bench engine [--arch A] [--dp 2]  # engine vs HF generate (8 / 32 concurrent; multi-turn,
                                                            # prefix cache on / off; the same cores as --dp engines);
                                                            # routed-expert capture overhead
    python -m experiments.bench sampling                    # one decode step's sampling: row by row vs batched (ms)
    python -m experiments.bench r3 --quick                  # R3: |delta log p| engine vs trainer, replay off / on;
                                                            # capture overhead
    python -m experiments.bench tito --quick [--harness client|harbor]  # TITO: naive re-tokenisation vs TITO
                                                            # through the token gateway
    python -m experiments.bench cp [--kappas 1 2 4 8] [--seq-len 1024]  # CP Gated DeltaNet: exactness, activation
                                                            # peak vs kappa
    python -m experiments.bench copy [--arch qwen3_moe qwen3_5_moe] [--steps 1000] [--seed 0] [--share 0.5]  # copy
                                                            # gate vs steps on corpus pieces, random names never
                                                            # trained on and unseen-vocabulary names; pieces / char
    python -m experiments.bench pg-snr runs/x [--ckpt sft] [--steps 1 2 3] [--n 96]  # policy-gradient signal / noise
                                                            # per trajectory
    python -m experiments.bench trainer [--shape t1-tiny|probe|122b-slice] [train_t1 flags]  # the trainer's Megatron
                                                            # path on this node: step time, dlogp, peak memory vs
                                                            # the memory model
    python -m experiments.bench update [--quick] [--repeats 3] [--threads 1]  # ppo.train_step vs the same
                                                            # passes on unpadded rows (--full's update; ratio)
    python -m experiments.bench plot runs/x [--out PNG]     # a run's curves (runs/x/curves.png)
    python -m experiments.bench compare A B                 # two evaluations paired; exit 1 naming the file that
                                                            # evaluated nothing
    python -m experiments.bench evaluate CKPT RUN OUT [--splits test ...]  # CKPT on run RUN's splits, RUN's
                                                            # protocol: OUT/<split>_step_N.json, for compare

The code of each lives by what it measures: experiments/engine_speed.py (engine, sampling), experiments/mechanisms.py
(r3, tito, cp), experiments/training.py (trainer, update, copy, pg-snr), report.py (plot and the paired tests of
compare); compare and evaluate are here.
Ratios are measured in one run (interleaved where a shared machine drifts), never asserted in tests; the figures
measured so far are in RESULTS.md (the headline tables) and results/LOG.md (the dated log).
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tasks import copying  # the standard library only (its defaults name the flags')

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train_t1.py, engine/, results/, ...
ARCHS = ("qwen3_5_moe", "qwen3_moe")  # model.ARCHS, named here so that --help answers before torch imports
SHAPES = ("t1-tiny", "probe", "122b-slice")  # training.trainer_bench's shapes
SPLIT_NAMES = ("test", "test_deep", "test_names", "val")  # runstate.SPLITS, named here for the same reason


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: --help and bad flags answer before torch loads)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine", help="engine vs HF generate, multi-turn prefix cache, capture (one JSON line)",
                       formatter_class=fmt)
    e.add_argument("--arch", choices=ARCHS, default="qwen3_moe", help="the tiny model's architecture")
    e.add_argument("--repeats", type=int, default=3, help="repeats of every workload, interleaved")
    e.add_argument("--quick", action="store_true", help="small sizes (the test's form; figures not meaningful)")
    e.add_argument("--threads", type=int, default=2, help="torch threads of this process and of each engine")
    e.add_argument("--dp", type=int, default=2, help="also the same threads as this many engines (0: not measured)")
    e.add_argument("--hf-compile", action="store_true",
                   help="also HF with a static cache and torch.compile (minutes of compiling; no gain measured here)")
    sm = sub.add_parser("sampling", help="one decode step's sampling, row by row vs batched (one JSON line)",
                        formatter_class=fmt)
    sm.add_argument("--threads", type=int, default=2, help="torch threads")
    s = sub.add_parser("r3", help="engine vs trainer logprobs with replay off / on (one JSON line)",
                       formatter_class=fmt)
    s.add_argument("--quick", action="store_true", help="8 requests x 24 tokens (under a minute on 2 cores)")
    s.add_argument("--seed", type=int, default=0, help="the model's init and the requests' sampling seeds")
    s.add_argument("--threads", type=int, default=2, help="torch threads")
    m = sub.add_parser("tito", help="naive re-tokenisation vs TITO through the token gateway (one JSON line)",
                       formatter_class=fmt)
    m.add_argument("--quick", action="store_true", help="a few tasks and turns (minutes on 2 CPU cores)")
    m.add_argument("--harness", choices=["client", "harbor"], default="client",
                   help="client: a text client that re-renders the history like Terminus-2; harbor: Harbor's own")
    m.add_argument("--work-dir", default=None,
                   help="where tasks, checkpoint and trials go (default: %(default)s, a new temp dir)")
    m.add_argument("--ckpt", default=None,
                   help="the checkpoint that samples (default: %(default)s, a random-init tiny model)")
    cb = sub.add_parser("cp", help="CP Gated DeltaNet: exactness and activation peak vs kappa (a table)",
                        formatter_class=fmt)
    cb.add_argument("--kappas", type=int, nargs="+", default=[1, 2, 4, 8], help="context-parallel ranks to try")
    cb.add_argument("--seq-len", type=int, default=1024, help="sequence length of the Gated DeltaNet input")
    cg = sub.add_parser("copy", help="the copy gate: greedy copy accuracy vs base-phase steps on the corpus's pieces, "
                        "on random names never trained on and on unseen-vocabulary task names (JSON lines; the "
                        "first: the tokenizer's pieces per character on each)", formatter_class=fmt)
    cg.add_argument("--arch", nargs="+", default=["qwen3_moe"], choices=ARCHS, help="architectures, one after another")
    cg.add_argument("--steps", type=int, default=1000, help="base-phase steps (a row every 100)")
    cg.add_argument("--threads", type=int, default=2, help="torch threads")
    cg.add_argument("--seed", type=int, default=0, help="tasks, tokenizer, init and data order (seed spread)")
    cg.add_argument("--share", type=float, default=copying.NAME_SHARE,
                    help="share of the copied items that are random names (tasks/copying.py); 0: the corpus's pieces "
                    "alone (the base phase before random names)")
    cg.add_argument("--names", type=int, default=copying.N_NAMES, help="random names trained on")
    cg.add_argument("--tokenizer-names", type=int, default=0, help="other random names added to the tokenizer's "
                    "training texts (0: the corpus alone, as train_t1's tokenizer)")
    sn = sub.add_parser("pg-snr", help="a run's per-trajectory policy-gradient signal / noise (one JSON line)",
                        formatter_class=fmt)
    sn.add_argument("run_dir", help="a train_t1.py run directory (its samples/ and ckpt/)")
    sn.add_argument("--ckpt", default="sft", help="ckpt/<name> whose gradient is measured (sft, latest)")
    sn.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3], help="RL steps whose samples are used")
    sn.add_argument("--n", type=int, default=96, help="trajectories")
    sn.add_argument("--threads", type=int, default=2, help="torch threads")
    tb = sub.add_parser("trainer", help="the trainer's Megatron path on this node (one JSON line); flags it does "
                        "not know go to train_t1.py's parser (--preset, --param-dtype, ...)", formatter_class=fmt)
    tb.add_argument("--shape", choices=SHAPES, default="t1-tiny",
                    help="the model: infra's t1-tiny, cluster.gpu_check.probe_config(), or 4 layers of the 122B's "
                    "widths")
    tb.add_argument("--tokens", type=int, default=256, help="tokens per trajectory")
    tb.add_argument("--samples", type=int, default=4, help="trajectories per step")
    tb.add_argument("--steps", type=int, default=2, help="train steps timed")
    up = sub.add_parser("update", help="ppo.train_step (and the padded update before it) vs the same passes on "
                        "unpadded rows, the --full preset's sizes (one JSON line)", formatter_class=fmt)
    up.add_argument("--quick", action="store_true", help="4 trajectories of ~60 tokens (the test's form; figures not "
                    "meaningful)")
    up.add_argument("--repeats", type=int, default=3, help="repeats of each of the three, interleaved")
    up.add_argument("--samples", type=int, default=32, help="trajectories per step (--full: 32 kept)")
    up.add_argument("--mean-len", type=int, default=776, help="mean tokens per trajectory (--full's RL steps)")
    up.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's beside the rollout on 2 "
                    "cores: 1)")
    pl = sub.add_parser("plot", help="PNG curves of a run directory (reward, solve rate, EV, |dlogp|, ...)",
                        formatter_class=fmt)
    pl.add_argument("run_dir", help="a train_t1.py run directory (its metrics.jsonl)")
    pl.add_argument("--out", default=None, help="the PNG to write (default: %(default)s, which is RUN/curves.png; "
                    "a run under the repository's results/ needs --out, so that a tracked figure is not overwritten)")
    cm = sub.add_parser("compare", help="two held-out evaluations (RUN/evals/step_N.json), paired (one JSON line)",
                        formatter_class=fmt)
    cm.add_argument("a", help="the first evaluation (the reference)")
    cm.add_argument("b", help="the second evaluation, tested against the first")
    ev = sub.add_parser("evaluate", help="a checkpoint on another run's splits with that run's evaluation protocol "
                        "(a JSON line per split; the evaluations as the run writes them, for compare)",
                        formatter_class=fmt)
    ev.add_argument("ckpt", help="the checkpoint to evaluate (model.save_checkpoint's directory, e.g. RUN/ckpt/sft)")
    ev.add_argument("run_dir", help="the train_t1.py run whose splits (state.json) and protocol (args.json) are used")
    ev.add_argument("out_dir", help="where the evaluations, the log and the trials go (created)")
    ev.add_argument("--splits", nargs="+", default=["test"], choices=SPLIT_NAMES, help="runstate.SPLITS names")
    ev.add_argument("--step", type=int, default=0, help="the step in the files' names (0: as a run's SFT evaluation)")
    return p


def parse(argv=None) -> tuple[argparse.Namespace, list]:
    """-> (the command's flags, the train_t1.py flags after them: `trainer` only; any other command refuses them).
    `plot` of a run under the repository's results/ without --out is refused: its figures there are tracked."""
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if rest and args.cmd != "trainer":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "plot" and args.out is None and (ROOT / "results") in Path(args.run_dir).resolve().parents:
        p.error(f"plot: {args.run_dir} is under results/ (tracked figures): pass --out PNG to write elsewhere")
    return args, rest


if __name__ == "__main__":
    ARGV = parse()  # --help and bad flags answer here, before torch loads

import torch  # noqa: E402

import model  # noqa: E402
import report  # noqa: E402
import rollout  # noqa: E402
import runstate  # noqa: E402
import train_t1  # noqa: E402  (its parser gives `trainer` its Args; the experiments may import the entry point)
from experiments import engine_speed, mechanisms, training  # noqa: E402


def compare(path_a: str, path_b: str) -> dict:
    """`python -m experiments.bench compare A B`: two held-out evaluations of one run or two
    (evals/step_NNNNNN.json, runstate.eval_row) over the same tasks: each one's solve rate with its 95% interval
    and tasks solved per family (the task name's last part), then the paired tests of B against A (report.paired).
    ValueError naming the file when one is not an evaluation, or evaluated nothing (no trials, or every trial
    errored / was cancelled: rollout.trial_failed)."""
    evs, rows = [], {}
    for key, path in (("a", path_a), ("b", path_b)):
        try:
            ev = json.loads(Path(path).read_text())
            fams = {}
            for t in ev["trials"]:
                fams.setdefault(t["task"].rsplit("-", 1)[-1], []).append(bool(t["resolved"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"compare: {path} is not an evaluation with per-trial rows (evals/step_*.json): "
                             f"{type(e).__name__}: {e}") from None
        k, n = sum(sum(v) for v in fams.values()), len(ev["trials"])
        failed = sum(rollout.trial_failed(t) for t in ev["trials"] if "exit_reason" in t)
        if n == 0 or failed == n:  # nothing was evaluated: a solve rate of 0 here would be a silent zero
            raise ValueError(f"compare: {path} evaluated nothing: " + (
                "it has no trials" if n == 0 else
                f"all {n} trials failed before a verdict (first: {ev['trials'][0].get('error')!r})"))
        rows[key] = {"path": path, "solve_rate": round(k / max(1, n), 4),
                     "ci": [round(x, 4) for x in report.wilson(k, n)],
                     "n": n, "per_family": {f: sum(v) for f, v in sorted(fams.items())}}
        evs.append(ev)
    t = report.paired(*evs)
    t["reward_diff_ci"] = [round(x, 4) for x in t["reward_diff_ci"]]
    return {**rows, **{k: round(v, 4) if isinstance(v, float) else v for k, v in t.items()}}


def evaluate(ckpt, run_dir, out_dir, splits=("test",), step: int = 0) -> dict:
    """`python -m experiments.bench evaluate CKPT RUN OUT`: checkpoint CKPT on run RUN's splits (state.json's task
    dirs) with RUN's protocol (runstate.evaluate under RUN's args.json: attempts, sampling, limits, S), through one
    embedded engine of RUN's --engine-weight-dtype on this process's torch threads, and this process's trials
    (--rollout-workers side by side, not --deterministic's one at a time). Writes OUT/<split file prefix>_<step>.json
    (refused if one exists: an evaluation is never overwritten) as a run writes its evaluations
    (runstate.eval_row), so that `compare` pairs them with RUN's own: an A/B of one change on one seed's splits.
    -> {split: {solve_rate, reward_mean, n_trials, n_errors, path}}. ValueError naming what is missing (a split RUN
    did not draw, a task dir not on disk, a checkpoint without its tokenizer)."""
    run, out = Path(run_dir), Path(out_dir)
    try:
        saved = json.loads((run / "args.json").read_text())
        state = json.loads((run / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"evaluate: {run} is not a run directory with args.json and state.json: {e}") from None
    fields = {f.name for f in dataclasses.fields(train_t1.Args)}  # today's defaults under the run's own values
    args = dataclasses.replace(train_t1.parse_args([]), **{k: v for k, v in saved.items() if k in fields})
    drawn = runstate.split_dirs(state, splits)
    if set(splits) - set(drawn):
        raise ValueError(f"evaluate: {run} drew no {sorted(set(splits) - set(drawn))} split (it has "
                         f"{sorted(runstate.split_dirs(state))})")
    if args.eval_attempts < 1:
        raise ValueError(f"evaluate: {run} ran with --eval-attempts {args.eval_attempts}: no protocol to repeat")

    def where(d, name):  # a run records its task dirs under its own --run-dir as it was given
        try:
            return d if Path(d).is_absolute() else str(run / Path(d).relative_to(saved.get("run_dir")))
        except (TypeError, ValueError):
            raise ValueError(f"evaluate: task dir {d!r} of split {name} is neither absolute nor under the run's "
                             f"--run-dir {saved.get('run_dir')!r}") from None
    dirs = {}
    for name, ds in drawn.items():
        dirs[name] = [where(d, name) for d in ds]
        missing = [d for d in dirs[name] if not Path(d, "task.toml").is_file()]
        if missing:
            raise ValueError(f"evaluate: {len(missing)} task dir(s) of split {name} not on disk, e.g. {missing[0]}")
    paths = {name: out / f"{runstate.SPLITS[name][1]}_{step:06d}.json" for name in dirs}
    there = [str(p) for p in paths.values() if p.exists()]
    if there:
        raise ValueError(f"evaluate: {there[0]} exists (an evaluation is never overwritten: another OUT or --step)")
    tok, why = rollout._load_tokenizer(str(ckpt))
    if why:
        raise ValueError(f"evaluate: {why}")
    out.mkdir(parents=True, exist_ok=True)
    proc, url = engine_speed._serve(str(ckpt), torch.get_num_threads(), dtype=args.engine_weight_dtype)
    res = {}
    try:
        for name, ds in dirs.items():
            ev = runstate.evaluate(ds, args, out, tok, None, [url], f"{name} of {ckpt}")
            path = paths[name]
            path.write_text(json.dumps({**ev, "after_step": step, "split": name, "ckpt": str(ckpt), "run": str(run)}))
            res[name] = {**{k: ev[k] for k in ("solve_rate", "reward_mean", "n_trials", "n_errors")}, "path": str(path)}
    finally:
        proc.kill()
        proc.wait()
    return res


def main(argv=None) -> None:
    """Run one command: argv is a list of flags, or what parse() returned."""
    args, rest = argv if isinstance(argv, tuple) else parse(argv)
    if set(ARCHS) != set(model.ARCHS):  # the parser's copy of the names has drifted from the model's
        raise SystemExit(f"experiments/bench.py: ARCHS {ARCHS} != model.ARCHS {model.ARCHS}")
    if args.cmd == "engine":
        torch.set_num_threads(args.threads)
        kw = dict(repeats=1, prompt_len=60, new_tokens=8, turns=2, turn_tokens=4, n_agents=2, capture_steps=4) \
            if args.quick else dict(repeats=args.repeats)
        print(json.dumps(engine_speed.engine_bench(args.arch, dp=args.dp, hf_compile=args.hf_compile, **kw)))
    elif args.cmd == "sampling":
        torch.set_num_threads(args.threads)
        print(json.dumps(engine_speed.sampling_bench()))
    elif args.cmd == "r3":
        torch.set_num_threads(args.threads)
        kw = (dict(n_requests=8, new_tokens=24, repeats=8) if args.quick
              else dict(n_requests=16, new_tokens=96, repeats=6))
        print(json.dumps(mechanisms.r3_measure(seed=args.seed, **kw)))
    elif args.cmd == "tito":
        print(json.dumps(mechanisms.tito_measure(quick=args.quick, harness=args.harness, work_dir=args.work_dir,
                                                 ckpt=args.ckpt)))
    elif args.cmd == "cp":
        mechanisms.cp_bench(args.kappas, dict(B=1, S=args.seq_len, nk=2, nv=4, dk=32, dv=32))
    elif args.cmd == "copy":
        torch.set_num_threads(args.threads)
        for arch in args.arch:
            training.copy_gate(arch, args.steps, seed=args.seed, share=args.share, n_names=args.names,
                               tokenizer_names=args.tokenizer_names)
    elif args.cmd == "pg-snr":
        torch.set_num_threads(args.threads)
        print(json.dumps(training.pg_snr(args.run_dir, args.ckpt, args.steps, args.n)))
    elif args.cmd == "trainer":
        print(json.dumps(training.trainer_bench(train_t1.parse_args(rest), args.shape, args.tokens, args.samples,
                                                args.steps)))
    elif args.cmd == "update":
        torch.set_num_threads(args.threads)
        kw = dict(n=4, mean_len=60, sd_len=15, repeats=1) if args.quick else dict(n=args.samples,
                                                                                  mean_len=args.mean_len,
                                                                                  repeats=args.repeats)
        a = train_t1.FULL if not args.quick else dataclasses.replace(train_t1.FULL, minibatch_size=2)
        print(json.dumps(training.update_bench(a, **kw)))
    elif args.cmd == "plot":
        print(report.plot(args.run_dir, args.out))
    elif args.cmd == "evaluate":
        try:
            print(json.dumps(evaluate(args.ckpt, args.run_dir, args.out_dir, args.splits, args.step)))
        except ValueError as e:
            sys.exit(f"experiments/bench.py {e}")
    else:
        try:
            print(json.dumps(compare(args.a, args.b)))
        except ValueError as e:  # a named reason and a non-zero exit, not a traceback or a silent zero
            sys.exit(f"experiments/bench.py {e}")


if __name__ == "__main__":
    main(ARGV)
