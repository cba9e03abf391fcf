"""experiments/seeds.py: the seed-blocked test's calibration on null data and its power, the t interval's coverage,
the loud errors, and collect + report over fabricated run folders (evaluation files as runstate.eval_row writes
them)."""
import json
import math

import numpy as np
import pytest

from experiments import seeds


def _ev(resolved: np.ndarray, reward: np.ndarray | None = None, errors: int = 0, prefix: str = "t",
        **extra) -> dict:
    """An evaluation of tasks x attempts (rows: tasks): its trials, solve rate and mean reward as eval_row writes."""
    reward = resolved.astype(float) if reward is None else reward
    n_tasks, attempts = resolved.shape
    trials = [{"task": f"{prefix}{i:03d}", "attempt": k, "resolved": bool(resolved[i, k]),
               "reward": float(reward[i, k]), "turns": 3, "exit_reason": "task_complete", "error": None}
              for k in range(attempts) for i in range(n_tasks)]
    for t in trials[:errors]:
        t.update(resolved=False, reward=0.0, error="engine died", exit_reason="error")
    n = len(trials)
    return {"n_tasks": n_tasks, "attempts": attempts, "n_trials": n, "n_errors": errors,
            "solve_rate": sum(t["resolved"] for t in trials) / n, "reward_mean": sum(t["reward"] for t in trials) / n,
            "turns_mean": 3.0, "errors": [{"task": t["task"], "attempt": t["attempt"], "error": t["error"]}
                                          for t in trials[:errors]], "trials": trials, **extra}


def _run(root, name, seed, rl_steps, evals: dict, legacy=False):
    """A fabricated run folder: args.json and the evaluation files runstate.eval_row writes (runstate.SPLITS:
    step_N.json for split test, <split>_step_N.json for the others, each recording its split; legacy: without it)."""
    d = root / name
    (d / "evals").mkdir(parents=True)
    (d / "args.json").write_text(json.dumps({"seed": seed, "rl_steps": rl_steps, "n_heldout_tasks": 4}))
    for (split, step), ev in evals.items():
        stem = "step" if split == "test" else f"{split}_step"
        (d / "evals" / f"{stem}_{step:06d}.json").write_text(json.dumps(
            {**ev, "after_step": step, **({} if legacy else {"split": split})}))
    return d


def _binom_bounds(n: int, p: float, tail: float = 0.0005) -> tuple:
    """The counts k with P(X < k) < tail and P(X > k) < tail, X ~ Bin(n, p): a 99.9% acceptance region."""
    pmf = [math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)]
    cdf = np.cumsum(pmf)
    lo = int(np.searchsorted(cdf, tail))
    hi = int(np.searchsorted(cdf, 1 - tail))
    return lo, hi


def _null_draw(rng, n_seeds=3, n_tasks=30, attempts=3, shift=0.0):
    """Per seed, per task a solve probability (tasks differ a lot, seeds differ too); SFT and RL attempts drawn
    from it (RL's shifted by `shift`), averaged per task: the strata of blocked_test."""
    strata = []
    for _ in range(n_seeds):
        p = rng.uniform(0.05, 0.9, n_tasks)
        a = rng.binomial(attempts, p) / attempts
        b = rng.binomial(attempts, np.clip(p + shift, 0, 1)) / attempts
        strata.append((a, b))
    return strata


def test_blocked_test_false_positive_rate_on_null_data_is_alpha():
    """200 null draws of 3 seeds x 30 tasks (3 attempts averaged): rejections at 0.05 within the 99.9% binomial
    region of Bin(200, 0.05); the same for the shared-SFT form (3 RL evaluations against one SFT)."""
    rng = np.random.default_rng(1)
    lo, hi = _binom_bounds(200, 0.05)
    rej = sum(seeds.blocked_test(_null_draw(rng), n_perm=1000, seed=i)["p_greater"] < 0.05 for i in range(200))
    assert lo <= rej <= hi, (rej, lo, hi)
    rej_shared = 0
    for i in range(200):
        p = rng.uniform(0.05, 0.9, 30)
        ev = rng.binomial(3, p, size=(4, 30)) / 3  # SFT and 3 RL seeds of the same (null) quality
        rej_shared += seeds.blocked_test([(ev[0], ev[1:])], n_perm=1000, seed=i)["p_greater"] < 0.05
    assert lo <= rej_shared <= hi, (rej_shared, lo, hi)


def test_blocked_test_finds_a_clear_gain_and_its_direction():
    """RL + 0.2 on every task's solve probability, 3 seeds x 30 tasks: rejected in nearly every draw; the opposite
    one-sided p is large."""
    rng = np.random.default_rng(2)
    res = [seeds.blocked_test(_null_draw(rng, shift=0.2), n_perm=1000, seed=i) for i in range(50)]
    assert sum(r["p_greater"] < 0.05 for r in res) >= 45
    assert all(r["p_less"] > 0.5 for r in res) and all(0.05 < r["stat"] < 0.3 for r in res)


def test_blocked_test_matches_exact_enumeration_and_never_flips_across_seeds():
    """One stratum of differences (1, 1, 1): the exact sign-flip p is 1/8. Two strata: the statistic is the mean of
    the strata's means, not the mean over all pairs (a seed with more tasks does not weigh more)."""
    r = seeds.blocked_test([(np.zeros(3), np.ones(3))], n_perm=20000)
    assert r["stat"] == 1.0 and abs(r["p_greater"] - 1 / 8) < 0.01 and r["p_less"] == 1.0
    r = seeds.blocked_test([(np.zeros(2), np.ones(2)), (np.zeros(6), np.zeros(6))], n_perm=2000)
    assert r["stat"] == 0.5 and r["n_strata"] == 2 and r["n_pairs"] == 8


def test_t_interval_is_the_t_interval_and_covers_the_true_mean():
    """Quantiles as tabulated; on synthetic seeds (true gain 0.05, seed-to-seed sd 0.04, task noise), the 95%
    interval over 3 seeds covers 0.05 in a share of 400 draws inside Bin(400, 0.95)'s 99.9% region."""
    assert [round(seeds.t_quantile(0.975, d), 3) for d in (1, 2, 3, 9)] == [12.706, 4.303, 3.182, 2.262]
    m, lo, hi = seeds.t_interval([0.1, 0.2, 0.3])
    assert m == pytest.approx(0.2) and hi - m == pytest.approx(4.303 * 0.1 / math.sqrt(3), abs=1e-3)
    assert math.isnan(seeds.t_interval([0.1])[1])
    rng, cover = np.random.default_rng(3), 0
    for _ in range(400):
        gains = []
        for g in rng.normal(0.05, 0.04, 3):
            a = rng.normal(0.5, 0.2, 30)
            gains.append(float((a + g + rng.normal(0, 0.1, 30) - a).mean()))
        _, lo, hi = seeds.t_interval(gains)
        cover += lo <= 0.05 <= hi
    lo_k, hi_k = _binom_bounds(400, 0.95)
    assert lo_k <= cover <= hi_k, (cover, lo_k, hi_k)


def _three_seeds(tmp_path, legacy=False):
    """Seeds 1, 2, 3: 4 tasks x 3 attempts; split test everywhere, test_deep too, val at steps 0 and 8."""
    sft = np.array([[1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]])
    rl = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    dirs = []
    for s in (1, 2, 3):
        evals = {("test", 0): _ev(sft), ("test", 8): _ev(rl), ("test_deep", 0): _ev(sft, prefix="d"),
                 ("test_deep", 8): _ev(sft, prefix="d", errors=1 if s == 2 else 0), ("val", 0): _ev(sft),
                 ("val", 8): _ev(rl)}
        dirs.append(_run(tmp_path / "runs", f"r{s}", s, 8, evals, legacy=legacy))
    return dirs


def test_report_per_seed_and_pooled_over_splits(tmp_path):
    """Three seeds of fabricated evaluations (legacy files: no split recorded): per-task pass@1 with the attempts
    averaged, the gain per seed, pooled with its interval and the blocked test; val is not a reported split; a
    seed's errored trials stand beside its figures."""
    _three_seeds(tmp_path, legacy=True)
    rep = seeds.report([tmp_path / "runs"], n_perm=2000)
    assert [t["split"] for t in rep["splits"]] == ["test", "test_deep"]
    test, deep = rep["splits"]
    assert [r["seed"] for r in test["seeds"]] == [1, 2, 3]
    r = test["seeds"][0]
    assert r["sft_solve"] == pytest.approx((1 / 3 + 0 + 1 + 0) / 4)
    assert r["rl_solve"] == pytest.approx((1 + 1 / 3 + 1 + 0) / 4)
    assert r["gain_solve"] == pytest.approx(1 / 4) and r["n_tasks"] == 4 and r["attempts"] == [3, 3]
    p = test["pooled"]
    assert p["gain_solve"] == pytest.approx(1 / 4) and p["gain_solve_ci"] == pytest.approx([0.25, 0.25])
    assert p["p_solve"] < 0.05 and p["n_seeds"] == 3  # 2 tasks x 3 seeds all positive: 1/64 exactly
    assert deep["pooled"]["n_errors"] == [0, 1] and deep["seeds"][1]["n_errors"] == [0, 1]
    assert deep["pooled"]["gain_solve"] < 0  # the errored trial scored 0
    (tr,) = rep["transfer"]  # test_deep's gain minus test's, seed by seed
    assert tr["split"] == "test_deep" and tr["solve"]["per_seed"] == pytest.approx(
        [d["gain_solve"] - t["gain_solve"] for d, t in zip(deep["seeds"], test["seeds"])])
    assert tr["solve"]["mean"] == pytest.approx(-0.25 - 1 / 36)  # deep: no gain, one seed loses 1 of its 12 trials
    text = seeds.format_report(rep)
    assert "- gain on test (out-of-template: deeper RST) minus gain on test (in-template), solve rate: per seed " \
        "-0.250, -0.333, -0.250; mean -0.278 [" in text
    assert "### Split test (in-template): 3 seeds" in text and "### Split test (out-of-template" in text
    assert "| 2 | 4 x 3 / 3 |" in text and "0 of 12 / 1 of 12" in text
    assert "errored trials (scored 0): SFT 0 of 36, RL 1 of 36" in text and "n = 3" in text
    assert "- reading (solve rate): RL > SFT: the test (p < 0.05) and the interval over seeds (above 0) agree" in text
    assert "- reading (solve rate): RL > SFT not shown (p >= 0.05)" in text  # test_deep
    assert seeds.reading(0.01, -0.02, 0.1).endswith("not shown over seeds (the interval over seeds reaches 0)")
    assert seeds.reading(0.01, float("nan"), float("nan")).endswith("(one seed)")


@pytest.mark.parametrize("breakage, match", [
    ("no_sft", "no SFT \\(step 0\\) evaluation of split test_deep"),
    ("no_final", "no final RL \\(step 8\\) evaluation of split test"),
    ("dup_seed", "both seed 2"),
    ("tasks", "different tasks"),
    ("split_field", "records split 'test_names'"),
    ("legacy_and_new", "two evaluation files of split test at step 0"),
    ("nothing", "neither a run folder")])
def test_report_errors_loudly(tmp_path, breakage, match):
    d1, d2, d3 = _three_seeds(tmp_path)
    if breakage == "no_sft":
        (d2 / "evals" / "test_deep_step_000000.json").unlink()
    elif breakage == "no_final":
        (d3 / "evals" / "step_000008.json").unlink()
    elif breakage == "dup_seed":
        (d3 / "args.json").write_text(json.dumps({"seed": 2, "rl_steps": 8}))
    elif breakage == "tasks":
        (d1 / "evals" / "step_000008.json").write_text(json.dumps(_ev(np.ones((4, 3)), prefix="x")))
    elif breakage == "split_field":
        ev = json.loads((d1 / "evals" / "step_000000.json").read_text())
        (d1 / "evals" / "step_000000.json").write_text(json.dumps(dict(ev, split="test_names")))
    elif breakage == "legacy_and_new":
        (d1 / "evals" / "test_step_000000.json").write_text((d1 / "evals" / "step_000000.json").read_text())
    elif breakage == "nothing":
        (tmp_path / "runs" / "empty").mkdir()
    with pytest.raises(ValueError, match=match):
        seeds.report([tmp_path / "runs" / "empty"] if breakage == "nothing" else [tmp_path / "runs"], n_perm=100)


def test_collect_then_report_round_trip(tmp_path, capsys):
    """collect files a run under OUT/seed<N>/ (evals/, args.json, state.json, provenance.json with the commit and
    machine); the report of the collected folders equals the report of the runs; a second collect of the same seed
    is refused unless --replace; the CLI prints the table and writes --json."""
    dirs = _three_seeds(tmp_path)
    (dirs[0] / "state.json").write_text(json.dumps({"step": 8, "argv": ["train_t1.py", "--full", "--seed", "1"]}))
    (dirs[0] / "metrics.jsonl").write_text("{}\n")  # not an evaluation: not copied
    for d in dirs:
        seeds.collect(d, tmp_path / "results")
    dest = tmp_path / "results" / "seed1"
    assert sorted(p.name for p in (dest / "evals").iterdir()) == sorted(p.name for p in (dirs[0] / "evals").iterdir())
    assert (dest / "state.json").exists() and not (dest / "metrics.jsonl").exists()
    prov = json.loads((dest / "provenance.json").read_text())
    assert len(prov["commit"]) == 40 and prov["nproc"] >= 1 and prov["hostname"] and prov["date"].startswith("20")
    assert prov["command"] == ["train_t1.py", "--full", "--seed", "1"] and prov["commit_from"].startswith("this")
    assert json.loads((tmp_path / "results" / "seed2" / "provenance.json").read_text())["command"] is None
    a = seeds.report([tmp_path / "runs"], n_perm=500)
    b = seeds.report([tmp_path / "results"], n_perm=500)
    strip = [{k: v for k, v in r.items() if k != "dir"} for t in a["splits"] for r in t["seeds"]]
    assert strip == [{k: v for k, v in r.items() if k != "dir"} for t in b["splits"] for r in t["seeds"]]
    assert [t["pooled"] for t in a["splits"]] == [t["pooled"] for t in b["splits"]]
    with pytest.raises(FileExistsError, match="--replace"):
        seeds.collect(dirs[0], tmp_path / "results")
    seeds.collect(dirs[0], tmp_path / "results", replace=True)
    seeds.main(["report", str(tmp_path / "results"), "--json", str(tmp_path / "t.json"), "--n-perm", "500"])
    assert "### Split test (in-template): 3 seeds" in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())["splits"][0]["pooled"]["n_seeds"] == 3
    seeds.main(["report", str(dirs[0]), "--json", str(tmp_path / "one.json"), "--n-perm", "100"])  # one seed
    assert json.loads((tmp_path / "one.json").read_text())["splits"][0]["pooled"]["gain_solve_ci"] == [None, None]
    assert "(one seed: no interval over seeds)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="seeds.py report: .*neither a run folder"):
        seeds.main(["report", str(tmp_path / "runs" / "r1" / "evals")])
