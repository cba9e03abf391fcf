"""experiments/paper.py and its report (experiments/claims.py): the report from arm run directories (synthetic
ones, by hand), the verdicts, each seed's RL paired with its own seed's SFT, and the quick form end to end (a shared
SFT run, two arms, resume, the report and its pictures)."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments import claims, paper, seeds
import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ev(solved: list) -> dict:
    return {"n_trials": len(solved), "n_errors": 0, "solve_rate": sum(solved) / len(solved),
            "reward_mean": sum(solved) / len(solved),
            "turns_mean": 3.0, "trials": [{"task": f"h{i}", "attempt": 0, "resolved": bool(s), "reward": float(s)}
                                          for i, s in enumerate(solved)]}


def _arm(out, name, solved, rl_rows):
    d = out / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"eval_rl": _ev(solved), "rl_steps": len(rl_rows),
                                                "phase_times": {"rl": 100.0, "eval_rl": 20.0}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(dict(r, phase="rl", step=i + 1)) + "\n"
                                             for i, r in enumerate(rl_rows)))


def _tasks(root, counts: list) -> list:
    """Minimal held-out task dirs h0.. with these assertion counts (what paper.assertion_counts reads)."""
    dirs = []
    for i, n in enumerate(counts):
        d = root / f"h{i}"
        (d / "tests").mkdir(parents=True)
        (d / "environment").mkdir()
        (d / "tests" / "test.sh").write_text("#!/bin/bash\n")
        (d / "instruction.md").write_text("do it\n")
        (d / "task.toml").write_text(f'version = "1.0"\n[metadata]\nn_assertions = {n}\n')
        dirs.append(str(d))
    return dirs


def test_verdicts():
    assert claims.verdict(+5, +1, 0.01) == "agrees"
    assert claims.verdict(+5, +1, 0.2) == "same sign, n.s."
    assert claims.verdict(-5, +1, 0.01) == "disagrees"
    assert claims.verdict(-5, +1, 0.2) == "opposite sign, n.s."
    assert claims.verdict(0, +1, 1.0) == "no difference"


def test_report_from_run_directories(tmp_path):
    """40 held-out tasks: SFT solves 10, ppo 30 (+20 -0: the sign-flip p two-sided 2 / 2^20, the draws' floor
    2 / 10001), binary 12, grpo 31 (one more than ppo), cold with negative EV; the table says which claims hold, on
    which split, and the pictures are written; the rows without a test (R3's dlogp, TITO) give no verdict."""
    (tmp_path / "shared").mkdir()
    sft = [1] * 10 + [0] * 30
    (tmp_path / "shared" / "summary.json").write_text(json.dumps(
        {"eval_base": _ev([0] * 40), "eval_sft": _ev(sft), "phase_times": {"eval_sft": 30.0}}))
    row = {"reward_mean": 0.5, "explained_variance": 0.6, "dlogp": 0.0015, "dlogp_r3_off": 0.0025,
           "tito_drift_pct": 0.0}
    _arm(tmp_path, "ppo-s0", [1] * 30 + [0] * 10, [row, row])
    _arm(tmp_path, "binary-s0", [1] * 12 + [0] * 28, [row])
    _arm(tmp_path, "grpo-s0", [1] * 31 + [0] * 9, [dict(row, explained_variance=float("nan"),
                                                         all_fail_group_frac=0.25)])
    _arm(tmp_path, "cold-s0", [1] * 30 + [0] * 10, [dict(row, explained_variance=-3.0, explained_variance_traj=-1.5),
                                                       dict(row, explained_variance_traj=0.25)])
    text = paper.report(tmp_path)
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("|")}
    hard = "dense beats binary on the hard slice (>= 8 assertions)"
    assert "not found from here" in lines[hard]  # no shared state.json naming the held-out task dirs
    assert "not run" in lines["TITO vs naive re-tokenisation: loss-region drift"]
    (tmp_path / "shared" / "state.json").write_text(json.dumps({"tasks": {"heldout": _tasks(
        tmp_path / "tasks", [3] * 12 + [9] * 8 + [3] * 20)}}))  # h12..h19: 9 assertions, solved by ppo, not binary
    one = {"tasks": 8, "naive": {"turns": 40, "loss_region_drift_pct": 1.25, "cases": {}}, "tito": {
        "turns": 41, "loss_region_drift_pct": 0.0, "cases": {"strict": 30, "normalized": 0, "retokenized": 3,
                                                             "split": 0}}}
    (tmp_path / "tito.json").write_text(json.dumps({"sft": one, "random": dict(one, naive=dict(
        one["naive"], loss_region_drift_pct=70.5))}))
    text = paper.report(tmp_path)
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("|")}
    assert "| test (in-template) | dense 64.0 vs binary 47.2 | 8 of 40 held-out tasks: ppo - binary: solve rate " \
        "+1.000, tasks +8 -0 over 1 seed(s), seed-blocked sign-flip p = 0.008" in lines[hard]  # exact: 2 / 2^8
    assert lines[hard].endswith("| agrees (one seed) |")  # the test does not see another seed's checkpoints
    tito_row = lines["TITO vs naive re-tokenisation: loss-region drift"]
    assert "naive 1.2500% vs TITO 0.0000%" in tito_row and "retokenized 3" in tito_row
    assert "random-init model: naive 70.5000% vs TITO 0.0000%" in tito_row
    assert tito_row.endswith("| - (one measurement, no test) |")
    rl = lines["RL beats SFT on test"]
    assert "| test (in-template) |" in rl and "RL - SFT: solve rate +0.500, tasks +20 -0 over 1 seed(s), " \
        "seed-blocked sign-flip p = 0.0002;" in rl and rl.endswith("| agrees (one seed) |")
    assert "ppo - binary: solve rate +0.450, tasks +18 -0" in lines["dense reward beats binary"]
    assert lines["dense reward beats binary"].endswith("| agrees (one seed) |")
    assert lines["PPO with a critic beats GRPO"].endswith("| opposite sign, n.s. |")  # grpo solved one more
    assert "0.25 of groups" in lines["GRPO: groups where every sample failed"]
    assert "1 of 2 updates < 0; per trajectory over the first 4 steps -1.50 .. 0.25" in lines[
        "critic EV per update, cold (zero head) start"]
    assert "per trajectory" not in lines["critic EV per update, warm start"]  # rows without it (older runs)
    assert "0.0025 -> 0.0015" in lines["R3 cuts abs(dlogp)"]
    assert lines["R3 cuts abs(dlogp)"].endswith("| - (measured, no test) |")
    assert "not run" in lines["R3 on beats R3 off on held-out"]
    assert all((tmp_path / f"{n}.png").stat().st_size > 0 for n in ("reward", "ev", "dlogp"))
    assert "unfinished" not in text and (tmp_path / "report.md").read_text() == text
    assert "| ppo | 1 | 0.750 [" in text and "per seed" not in text  # one seed: its Wilson interval
    assert "Time: 8 min of phases in all (shared run 0, 4 arm runs 8, TITO measurement 0;" in text  # 4 x 120 s
    assert "ppo@val" not in lines and "RL beats SFT on test, at the step validation chose" not in lines
    sm = json.loads((tmp_path / "ppo-s0" / "summary.json").read_text())  # --n-val-tasks: the step validation chose
    sm["eval_rl_best_val"] = {**_ev([1] * 25 + [0] * 15), "step": 16, "val_solve_rate": 0.7}
    (tmp_path / "ppo-s0" / "summary.json").write_text(json.dumps(sm))
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in paper.report(tmp_path).splitlines() if ln.startswith("|")}
    assert lines["ppo@val"].startswith("| ppo@val | 1 | 0.625 [") and "| 16 (chosen) |" in lines["ppo@val"]
    assert "tasks +15 -0 over 1 seed(s)" in lines["RL beats SFT on test, at the step validation chose"]
    assert "binary@val" not in lines and "tasks +20 -0" in lines["RL beats SFT on test"]
    (tmp_path / "r3off-s0").mkdir()
    (tmp_path / "r3off-s0" / "state.json").write_text("{}")  # an arm that crashed before its summary
    assert "Failed or unfinished arm runs (not in the table; their stdout.log): r3off-s0" in paper.report(tmp_path)
    (tmp_path / "shared" / "state.json").write_text(json.dumps({"tasks": {"heldout": _tasks(
        tmp_path / "tasks2", [3] * 39 + [7])}}))
    assert "none of the 40 held-out tasks has >= 8 assertions (most: 7)" in paper.report(tmp_path)


# every run of the quick form at the smallest settings that still exercise it (tests/test_e2e.py's TINY): 8 + 3
# tasks (their pools and the SFT pool are TINY's, so the suite's task cache serves them), no base phase (the e2e
# runs test it; a shared run without one has no BASE row), a one-task grpo group of 4 (--n-launch 4:
# experiments/paper.py makes G 4), short trials, no evaluation on training tasks
SMALL = ["--n-train-tasks", "8", "--n-heldout-tasks", "3", "--n-sft-tasks", "6", "--n-launch", "4", "--n-keep", "4",
         "--critic-warmup-trials", "4", "--base-steps", "0", "--sft-epochs", "1", "--max-turns", "3",
         "--eval-max-turns", "3", "--max-new-tokens", "48", "--rollout-workers", "4", "--minibatch-size", "2",
         "--eval-train-tasks", "0", "--rollout-actors", "1"]  # two rollout actors: tests/test_e2e.py


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="the sandbox needs root and bwrap")
def test_quick_form_end_to_end(tmp_path, capsys):
    """`python -m experiments.paper run --quick` with two arms (grpo: G samples per task, the shared warmed critic;
    binary: its own critic warm-up on its own reward; the ppo arm is the plain pipeline of tests/test_e2e.py) and
    train_t1 flags after -- (SMALL, which every run gets): the shared SFT run, each arm's RL from a copy of it (same
    tasks and SFT evaluation), the report; run again (in this process), the finished arms are kept (nothing re-run)
    and the report rewritten."""
    out = tmp_path / "paper"
    argv = ["run", "--quick", "--arms", "grpo", "binary", "--out", str(out), "--rl-steps", "1", "--", *SMALL]
    res = subprocess.run([sys.executable, "-m", "experiments.paper", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    shared = json.loads((out / "shared" / "state.json").read_text())
    assert len(shared["tasks"]["train"]) == 8 and len(shared["tasks"]["heldout"]) == 3  # the flags reached it
    for arm in ("grpo-s0", "binary-s0"):
        st = json.loads((out / arm / "state.json").read_text())
        assert st["step"] == 1 and st["tasks"] == shared["tasks"] and st["eval_sft"] == shared["eval_sft"]
        args = json.loads((out / arm / "args.json").read_text())
        assert (args["n_launch"], args["critic_warmup_trials"], args["max_turns"]) == (4, 4, 3)  # ... and each arm
    grpo = [json.loads(ln) for ln in open(out / "grpo-s0" / "metrics.jsonl") if '"phase": "rl"' in ln]
    assert grpo and "all_fail_group_frac" in grpo[0]
    assert json.loads((out / "grpo-s0" / "args.json").read_text())["samples_per_task"] == 4
    assert "critic_warmup" in json.loads((out / "binary-s0" / "state.json").read_text())  # warmed in the arm
    assert (out / "binary-s0" / "ckpt" / "critic_warm.pt").exists()
    report = (out / "report.md").read_text()
    assert "| binary | 1 |" in report and "| grpo | 1 |" in report and "PPO with a critic beats GRPO" in report
    tito = json.loads((out / "tito.json").read_text())  # the SFT and a random model through the gateway
    assert tito["sft"]["ckpt"] == str(out / "shared" / "ckpt" / "sft") and tito["sft"]["naive"]["turns"]
    assert tito["sft"]["tito"]["loss_region_drift_pct"] == tito["random"]["tito"]["loss_region_drift_pct"] == 0.0
    assert tito["random"]["naive"]["loss_region_drift_pct"] > 0  # a random model's tokens are not canonical
    assert "| TITO vs naive" in report and "random-init model: naive" in report
    mtime = {arm: (out / arm / "summary.json").stat().st_mtime for arm in ("grpo-s0", "binary-s0", "shared")}
    (out / "report.md").unlink()
    paper.main(argv)
    assert {arm: (out / arm / "summary.json").stat().st_mtime for arm in mtime} == mtime
    assert "| binary | 1 |" in (out / "report.md").read_text() and "| grpo | 1 |" in capsys.readouterr().out


def test_seed_arm_after_a_kill_mid_copy_and_torn_files(tmp_path):
    """A kill while an arm was being seeded (its checkpoints half copied, no state.json yet) does not stop the next
    run from seeding it; the files experiments/paper.py and train_t1 write for it are written whole (tmp + rename)."""
    shared = tmp_path / "shared"
    for name in ("base", "sft"):
        (shared / "ckpt" / name).mkdir(parents=True)
        (shared / "ckpt" / name / "config.json").write_text("{}")
        (shared / "ckpt" / name / "model.safetensors").write_text("w" * 100)
    (shared / "ckpt" / "critic_warm.pt").write_text("c")
    (shared / "state.json").write_text(json.dumps({"tasks": {}, "reward_scale": 5, "eval_sft": {}, "step": 0}))
    arm = tmp_path / "ppo-s0"
    (arm / "ckpt" / "base").mkdir(parents=True)  # the kill: base half copied, sft not yet, no state.json
    (arm / "ckpt" / "base" / "config.json").write_text("{}")
    paper.seed_arm(shared, arm, "ppo")
    assert (arm / "ckpt" / "base" / "model.safetensors").read_text() == "w" * 100
    assert (arm / "ckpt" / "sft" / "model.safetensors").exists() and (arm / "ckpt" / "critic_warm.pt").exists()
    assert json.loads((arm / "state.json").read_text())["step"] == 0
    for src in (paper.__file__, os.path.join(ROOT, "train_t1.py")):  # no plain write_text of a file a resume reads
        text = open(src).read()
        for name in ("state.json", "summary.json", "tito.json"):
            assert f'/ "{name}").write_text(' not in text, f"{src}: {name} written in place"


@pytest.mark.parametrize("argv, what", [(["--seeds", "0"], "--seeds 0"), (["--rl-steps", "0"], "--rl-steps 0"),
                                        (["--", "--r3-mode", "off"], "--r3-mode"),
                                        (["--", "--seed=3", "--lr", "1"], "--seed")])
def test_run_refuses_flags_that_would_break_the_comparison(argv, what, capsys):
    """--seeds 0 / --rl-steps 0 were read as the defaults; a train_t1 flag after -- that experiments/paper.py sets per
    arm (R3, reward, advantage, warm-up, seed, run dir) would win over the arm's own and make every arm the same."""
    with pytest.raises(SystemExit) as e:
        paper.main(["run", "--quick", *argv])
    assert e.value.code == 2 and what in capsys.readouterr().err


def test_arms_run_the_presets_rl_steps_not_the_shared_runs_zero():
    """The shared run is a train_t1 run with --rl-steps 0, so its args.json holds 0; the arms' steps come from the
    preset (read as 1 before: every arm of `bash run.sh paper` ran one RL step)."""
    import train_t1
    assert paper.preset_steps([], []) == train_t1.EMBEDDED.rl_steps == 8
    assert paper.preset_steps(["--quick"], []) == train_t1.QUICK.rl_steps
    assert paper.preset_steps(["--full"], ["--eval-every", "4"]) == train_t1.FULL.rl_steps
    with pytest.raises(ValueError, match="refused the flags"):
        paper.preset_steps([], ["--actor-lr", "fast"])


def test_report_of_a_directory_without_a_shared_run_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no finished shared run under"):
        paper.main(["report", str(tmp_path / "nothing")])


def test_report_over_two_seeds_shows_each_seed_and_the_t_interval(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "summary.json").write_text(json.dumps({"eval_sft": _ev([1] * 10 + [0] * 30),
                                                                  "phase_times": {"sft": 60.0}}))
    row = {"reward_mean": 0.5, "explained_variance": 0.6, "dlogp": 0.0015, "dlogp_r3_off": 0.0025}
    _arm(tmp_path, "ppo-s0", [1] * 20 + [0] * 20, [row])
    _arm(tmp_path, "ppo-s1", [1] * 18 + [0] * 22, [row])
    text = paper.report(tmp_path)
    half = 12.706 * (0.05 / 2 ** 0.5) / 2 ** 0.5  # t(1) x sd / sqrt(2) of 0.500, 0.450
    assert f"| ppo | 2 | 0.475 [{0.475 - half:.3f}, {0.475 + half:.3f}]; per seed 0.500, 0.450 |" in text
    # RL vs the one shared SFT: one stratum (the SFT outcomes counted once), the seeds' gains each
    half = 12.706 * (0.05 / 2 ** 0.5) / 2 ** 0.5  # the seeds' gains 0.250, 0.200: their t interval reaches 0
    assert f"RL - SFT: solve rate +0.225 (per seed +0.250, +0.200; 95% t interval over seeds [{0.225 - half:+.3f}, " \
        f"{0.225 + half:+.3f}]), tasks +18 -0 over 2 seed(s) against 1 shared SFT evaluation(s)" in text
    assert "| agrees (these seeds; the interval over seeds reaches 0) |" in text
    _arm(tmp_path, "binary-s0", [1] * 38 + [0] * 2, [row])
    _arm(tmp_path, "binary-s1", [1] * 20 + [0] * 20, [row])
    assert "| binary | 2 | 0.725 [0.000, 1.000]; per seed 0.950, 0.500 |" in paper.report(tmp_path)  # clipped
    _arm(tmp_path, "cold-s0", [1] * 20 + [0] * 20, [row])
    _arm(tmp_path, "cold-s1", [0] * 20 + [1] * 20, [row])  # seeds that agree on the rate: the pooled Wilson interval
    lo, hi = report.wilson(40, 80)
    assert f"| cold | 2 | 0.500 [{lo:.3f}, {hi:.3f}]; per seed 0.500, 0.500 |" in paper.report(tmp_path)


def test_seed_goes_to_the_shared_run_and_a_resume_with_another_is_refused(tmp_path, monkeypatch):
    """--seed S: the shared run is train_t1 --seed S (its tasks, base, SFT); resuming a shared run of another seed
    is refused (its arms would pair other tasks)."""
    import train_t1
    cmds = []

    def fake_run(cmd, d, steps, name):
        cmds.append(cmd)
        d.mkdir(parents=True, exist_ok=True)
        if name.endswith(": SFT"):
            seed = int(cmd[cmd.index("--seed") + 1])
            (d / "summary.json").write_text("{}")
            (d / "state.json").write_text(json.dumps({"phase_times": {}}))
            (d / "args.json").write_text(json.dumps({**dataclasses.asdict(train_t1.QUICK), "seed": seed}))
        else:
            (d / "summary.json").write_text(json.dumps({"rl_steps": steps}))
        return 0
    monkeypatch.setattr(paper, "run_logged", fake_run)
    monkeypatch.setattr(paper, "seed_arm", lambda shared, d, arm: None)
    monkeypatch.setattr(paper, "tito_step", lambda out, quick: 0)  # (it would start two bench processes)
    paper.run(tmp_path, ["--quick"], ["ppo"], 2, 1, [], seed=7)
    assert cmds[0][cmds[0].index("--seed") + 1] == "7"
    assert [c[c.index("--seed") + 1] for c in cmds[1:]] == ["7", "8"]
    with pytest.raises(ValueError, match="--seed 5: the shared run .* has seed 7"):
        paper.run(tmp_path, ["--quick"], ["ppo"], 2, 1, [], seed=5)


def test_the_report_goes_into_the_dated_log_as_its_newest_entry(tmp_path):
    """results/LOG.md is newest first: paper's report becomes the entry above the first dated one (appended at the end
    it would sit under the oldest), and a new file gets the entry alone."""
    log = tmp_path / "LOG.md"
    log.write_text("# The dated log\n\nhow to read it\n\n## 2026-12-05: older\n\nold body\n")
    paper.add_log_entry(log, "## 2026-12-06: newer", "### table\n| a |")
    text = log.read_text()
    assert text.index("how to read it") < text.index("## 2026-12-06: newer") < text.index("## 2026-12-05: older")
    assert "| a |\n\n## 2026-12-05" in text and text.endswith("old body\n")
    paper.add_log_entry(tmp_path / "new.md", "## 2026-12-06: first", "body")
    assert (tmp_path / "new.md").read_text() == "## 2026-12-06: first\n\nbody\n"


def test_r3_row_and_curve_skip_steps_without_the_r3_off_diagnostic(tmp_path):
    """--r3-off-every K: a step without the diagnostic has dlogp_r3_off NaN; the R3 row compares on and off over the
    steps that ran it (not NaN, not the other steps' dlogp) and the dlogp picture is still drawn."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "summary.json").write_text(json.dumps(
        {"eval_base": _ev([0] * 4), "eval_sft": _ev([1, 0, 0, 0]), "phase_times": {"eval_sft": 30.0}}))
    row = {"reward_mean": 0.5, "explained_variance": 0.6, "dlogp": 0.0015, "dlogp_r3_off": 0.0025,
           "tito_drift_pct": 0.0}
    _arm(tmp_path, "ppo-s0", [1, 1, 0, 0], [row, dict(row, dlogp=0.5, dlogp_r3_off=float("nan")), row])
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in paper.report(tmp_path).splitlines() if ln.startswith("|")}
    assert "0.0025 -> 0.0015" in lines["R3 cuts abs(dlogp)"]
    assert "0.0000%" in lines["TITO: loss-region drift"]
    assert (tmp_path / "dlogp.png").stat().st_size > 0


def test_each_seed_pairs_with_its_own_sft_and_every_test_split_has_its_row(tmp_path):
    """--sft-per-seed layout (OUT/shared-s<s>): ppo seed s against shared-s<s>'s SFT evaluation only (3 strata, no
    shared SFT), the same figures as experiments/seeds.py's test on those pairs; a split beyond test (test_deep, from
    the evals/ files) gets its own row, and a seed without that split's final evaluation is named, with no verdict."""
    sfts, rls = ([1] * 10 + [0] * 30, [1] * 20 + [0] * 20, [1] * 5 + [0] * 35), ([1] * 20 + [0] * 20,) * 3
    for s, (a, b) in enumerate(zip(sfts, rls)):
        sh = tmp_path / f"shared-s{s}"
        (sh / "evals").mkdir(parents=True)
        (sh / "summary.json").write_text(json.dumps({"eval_sft": _ev(a), "phase_times": {"sft": 60.0}}))
        (sh / "evals" / "test_deep_step_000000.json").write_text(json.dumps(dict(_ev([0] * 6), after_step=0)))
        _arm(tmp_path, f"ppo-s{s}", b, [{"reward_mean": 0.5}])
        sm = json.loads((tmp_path / f"ppo-s{s}" / "summary.json").read_text())
        (tmp_path / f"ppo-s{s}" / "summary.json").write_text(json.dumps(dict(sm, eval_sft=_ev(a))))  # its copy
        if s < 2:
            (tmp_path / f"ppo-s{s}" / "evals").mkdir()
            (tmp_path / f"ppo-s{s}" / "evals" / "test_deep_step_000001.json").write_text(json.dumps(
                dict(_ev([1] * 3 + [0] * 3), after_step=1)))
    text = paper.report(tmp_path)
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("|")}
    assert "| SFT (per seed) | 3 |" in text and "each seed its own tasks and SFT model" in text
    row = lines["RL beats SFT on test"]
    assert "per seed +0.250, +0.000, +0.375; 95% t interval over seeds [" in row
    assert "]), tasks +25 -0 over 3 seed(s), seed-blocked" in row
    assert "shared SFT" not in row  # three strata: each seed its own SFT
    ref = seeds.blocked_test([(np.array(a, float), np.array(b, float)) for a, b in zip(sfts, rls)])
    assert f"p = {min(1.0, 2 * min(ref['p_greater'], ref['p_less'])):.3g};" in row
    assert "no evaluation of this split: ppo-s2 (RL) | - |" in lines["RL beats SFT on test_deep"]
    assert "| test (out-of-template: deeper RST) |" in lines["RL beats SFT on test_deep"]
    (tmp_path / "ppo-s2" / "evals").mkdir()
    (tmp_path / "ppo-s2" / "evals" / "test_deep_step_000001.json").write_text(json.dumps(
        dict(_ev([1] * 2 + [0] * 4), after_step=1)))
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in paper.report(tmp_path).splitlines() if ln.startswith("|")}
    deep = lines["RL beats SFT on test_deep"]
    assert "RL - SFT: solve rate +0.444 (per seed +0.500, +0.500, +0.333; 95% t interval over seeds [+0.205, " \
        "+0.683]), tasks +8 -0 over 3 seed(s)" in deep and deep.endswith("| agrees |")  # the interval above 0


def test_sft_per_seed_runs_a_shared_phase_per_seed_and_seeds_each_arm_from_its_own(tmp_path, monkeypatch):
    """run(..., sft_per_seed=True): OUT/shared-s<s> with seed S + s, arm seed s seeded from it; an OUT made the other
    way is refused (its arms would pair with another SFT)."""
    import train_t1
    cmds, seeded = [], []

    def fake_run(cmd, d, steps, name):
        cmds.append((name, cmd[cmd.index("--seed") + 1]))
        d.mkdir(parents=True, exist_ok=True)
        if name.endswith(": SFT"):
            (d / "summary.json").write_text("{}")
            (d / "state.json").write_text(json.dumps({"phase_times": {}}))
            (d / "args.json").write_text(json.dumps({**dataclasses.asdict(train_t1.QUICK),
                                                     "seed": int(cmd[cmd.index("--seed") + 1])}))
        else:
            (d / "summary.json").write_text(json.dumps({"rl_steps": steps}))
        return 0
    monkeypatch.setattr(paper, "run_logged", fake_run)
    monkeypatch.setattr(paper, "seed_arm", lambda shared, d, arm: seeded.append((shared.name, d.name)))
    monkeypatch.setattr(paper, "tito_step", lambda out, quick: 0)
    paper.run(tmp_path, ["--quick"], ["ppo", "cold"], 2, 1, [], seed=7, sft_per_seed=True)
    assert cmds == [("shared-s0: SFT", "7"), ("ppo-s0", "7"), ("cold-s0", "7"), ("shared-s1: SFT", "8"),
                    ("ppo-s1", "8"), ("cold-s1", "8")]
    assert seeded == [("shared-s0", "ppo-s0"), ("shared-s0", "cold-s0"), ("shared-s1", "ppo-s1"),
                      ("shared-s1", "cold-s1")]
    assert [d.name for d in paper.shared_runs(tmp_path)] == ["shared-s0", "shared-s1"]
    with pytest.raises(ValueError, match="one per seed"):
        paper.run(tmp_path, ["--quick"], ["ppo"], 2, 1, [], seed=7)
