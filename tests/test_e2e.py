"""The tiny end-to-end run of the real pipeline: tasks -> SFT -> engine -> critic warm-up -> PPO -> eval, twice
side by side with one seed (the same to the digit), killed with SIGKILL in the middle of an RL step, then a resume
of the same run directory that redoes exactly that step (the same for --backend megatron, without the kill)."""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import rollout
from sandbox import task_io
import tito
import train_t1
from engine.client import EngineClient
from engine.server import EngineServer
from shared_runs import qwen35_sft  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--quick", "--n-train-tasks", "8", "--n-heldout-tasks", "3", "--n-launch", "5", "--n-keep", "4",
        "--critic-warmup-trials", "4", "--sft-epochs", "1", "--max-turns", "3", "--max-new-tokens", "48",
        "--rollout-workers", "5", "--minibatch-size", "2", "--eval-train-tasks", "2", "--n-sft-tasks", "6",
        "--base-steps", "1", "--sft-faults", "0.5", "--eval-max-turns", "3"]  # base: its phase and rows, not a
# model that copies; evaluation trials as short as the RL trials
TIMING = re.compile(r"time|tok_s|per_s|seconds|wall")  # the figures a clock gives: the only ones allowed to differ


def read_metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def run(run_dir, flags, kill_at=None, timeout=600):
    """train_t1.py in its own process; SIGKILL once `kill_at` shows in log.txt -> the log then."""
    proc = subprocess.Popen([sys.executable, "train_t1.py", "--run-dir", str(run_dir)] + flags, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        log = (run_dir / "log.txt").read_text() if (run_dir / "log.txt").exists() else ""
        if kill_at and kill_at in log:
            os.kill(proc.pid, signal.SIGKILL)  # the trainer only: the engine and sandboxes must die with it
            proc.wait()
            return log
        time.sleep(0.2)
    assert proc.wait(timeout=max(1, timeout - (time.time() - t0))) == 0
    return (run_dir / "log.txt").read_text()


def _untimed(rows):
    return [{k: v for k, v in r.items() if not TIMING.search(k)} for r in rows]


def test_tiny_pipeline_twice_to_the_digit_then_killed_mid_update_and_resumed(tmp_path):
    """The whole pipeline in its own process, twice side by side with one seed and --deterministic (trials one at a
    time in launch order: cluster/actors.run_rollouts), each killed with SIGKILL inside step 3's PPO update (step 4
    sampled beside it). Reproducible to the digit: the two wrote the same SFT data, the same evaluations (after SFT,
    and the validation split's after step 2) and step-2 weights byte for byte, and the same metrics but for wall
    times (side by side, their timings differ). Then a resume of one run directory that loses and repeats nothing
    (rundir.resume_run, the commit point state.json): every step's metrics and samples exist exactly once."""
    val = ["--n-val-tasks", "2", "--n-deep-tasks", "1", "--n-names-tasks", "1"]  # validation + two more test splits
    flags = TINY + val + ["--deterministic", "true"]  # seed 1: the 8 + 3 pool of the other pipelines (one generation)
    twin, run_dir = tmp_path / "twin", tmp_path / "run"
    with ThreadPoolExecutor(2) as pool:  # validation eval after step 2; killed inside step 3's update
        _, log = pool.map(lambda d: run(d, flags + ["--rl-steps", "4", "--eval-every", "2"],
                                        kill_at="step 3: actor update", timeout=900), (twin, run_dir))
    assert (twin / "samples" / "sft.jsonl").read_bytes() == (run_dir / "samples" / "sft.jsonl").read_bytes()
    evals = sorted(p.name for p in (run_dir / "evals").iterdir())
    assert evals == sorted(p.name for p in (twin / "evals").iterdir()) and "val_step_000002.json" in evals
    for name in evals:  # after SFT: every split; after step 2: validation
        ea, eb = (twin / "evals" / name).read_bytes(), (run_dir / "evals" / name).read_bytes()
        assert ea == eb, (name, json.loads(ea)["trials"], json.loads(eb)["trials"])
    ma, mb = _untimed(read_metrics(twin)), _untimed(read_metrics(run_dir))
    assert [r["phase"] for r in ma] == [r["phase"] for r in mb] and any(r["phase"] == "rl" for r in ma)
    for ra, rb in zip(ma, mb):
        assert ra == rb, (ra, rb)
    weights = "ckpt/latest/model.safetensors"  # step 2's: step 3 never checkpointed
    assert (twin / weights).read_bytes() == (run_dir / weights).read_bytes()
    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == 2  # step 3 never checkpointed
    # the Ray actors (trainer, engine, rollout workers) and their sandboxes die with the killed driver
    pids = [int(p) for p in re.findall(r"pid'?:? (\d+)", log.split("ray actors:")[1].splitlines()[0])]
    pids += [int(p) for p in re.findall(r"\[([\d, ]+)\]", log.split("rollout workers pids")[1])[0].split(",")]
    assert len(pids) >= 4
    deadline = time.time() + 30
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.5)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "an actor outlived the killed driver"
    while time.time() < deadline and subprocess.run(["pgrep", "-f", f"bwrap.*{run_dir}"]).returncode == 0:
        time.sleep(0.5)  # a jail ends once its lifeline's writer (the worker) is gone: asynchronous, not instant
    jails = subprocess.run(["pgrep", "-fa", f"bwrap.*{run_dir}"], capture_output=True, text=True)
    assert jails.returncode == 1, f"a sandbox outlived the killed driver: {jails.stdout[:300]}"

    recs = read_metrics(run_dir)  # the two committed steps, as the run wrote them
    assert {r["phase"] for r in recs} == {"base", "sft", "eval", "critic_warmup", "rl"}
    assert [r["step"] for r in recs if r["phase"] == "eval"] == [0, 2]  # SFT, then --eval-every 2
    rl = [r for r in recs if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert rl[0]["n_launched"] == 5 and rl[0]["n_kept"] + rl[0]["n_dropped"] == 5 and rl[0]["n_kept"] <= 4
    assert [r["staleness"] for r in rl] == [0, 1]  # one-step async: step 2 was sampled while step 1 trained
    assert np.isfinite(rl[0]["dlogp"])
    assert 0.0 <= rl[0]["reward_mean"] <= 1.0
    for r in rl:  # every turn after the first extends the trajectory the engine cached at the previous turn's end
        assert 0.0 <= r["prefix_cache_frac"] < 1.0 and (r["prefix_cache_frac"] > 0 or r["turns_mean"] <= 1.0), r
        assert r["engine_errors_500"] == 0, r  # the embedded engines count their 500s: none lost a trial
    assert (run_dir / "ckpt" / "latest" / "model.safetensors").exists()
    assert re.search(r"sft faults: 3 of 3 tasks replayed with a fault turn resolved, [1-9]\d* loss tokens", log)
    # critic before actor, observable in the log
    assert log.index("step 1: critic update") < log.index("step 1: actor update")
    # TITO samples on disk audit clean
    samples = tito.load_samples(run_dir / "samples" / "step_000001.jsonl")
    assert samples and tito.audit(samples)["loss_region_drift_pct"] == 0.0
    assert all(s["routed_experts"] is not None and s["routed_experts"].shape[0] == len(s["tokens"]) - 1
               for s in samples)

    # resume: the same run dir continues at step 3 (redone from its start), nothing repeated; this time against
    # an engine already running (--engine-urls, as cluster/launch.py launch passes its SGLang servers)
    engine = EngineServer(str(run_dir / "ckpt" / "sft"), port=0).start()
    try:
        summary = train_t1.train(train_t1.parse_args(flags + ["--run-dir", str(run_dir), "--rl-steps", "3",
                                                              "--engine-urls", engine.url]))
        assert EngineClient(engine.url).model_info()["weight_version"] == "3"  # published after step 3
    finally:
        engine.stop()
    for phase in ("eval_sft", "eval_rl"):
        assert summary[phase]["n_trials"] == 3 and 0.0 <= summary[phase]["solve_rate"] <= 1.0
    assert (run_dir / "curves.png").stat().st_size > 0
    rl = [r for r in read_metrics(run_dir) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert rl[2]["weight_version"] == 3 and rl[2]["staleness"] == 0
    held = [r for r in read_metrics(run_dir) if r["phase"] == "eval"]
    assert [r["step"] for r in held] == [0, 2, 3] and held[2]["heldout_n_trials"] == 3  # the last: after step 3
    # the validation split: its own instructions (none in the RL or test pools), scored after SFT and at steps 2
    # and 3; the test splits after SFT and the last step only; RL@val is the test evaluation of the step that did
    # best on validation among those with one (here the last)
    st = json.loads((run_dir / "state.json").read_text())
    assert len(st["tasks"]["val"]) == 2 and all(Path(d).name.startswith("val-") for d in st["tasks"]["val"])
    assert len(st["tasks"]["test_deep"]) == len(st["tasks"]["test_names"]) == 1
    ins = {k: {task_io.load_task(d).instruction for d in ds} for k, ds in st["tasks"].items()}
    ins["sft"] = {task_io.load_task(d).instruction for d in (run_dir / "tasks" / "sft" / "train").iterdir()}
    for k in ("val", "test_deep", "test_names"):
        assert not ins[k] & (ins["train"] | ins["heldout"] | ins["sft"]) and len(ins[k]) == len(st["tasks"][k])
    assert [r["val_n_trials"] for r in held] == [2, 2, 2] and "heldout_n_trials" not in held[1]
    assert [r.get("test_deep_n_trials") for r in held] == [1, None, 1] == [r.get("test_names_n_trials") for r in held]
    for k in ("test_deep", "test_names"):
        assert summary["eval_rl_splits"][k]["n_trials"] == summary["eval_sft_splits"][k]["n_trials"] == 1
        assert json.loads((run_dir / "evals" / f"{k}_step_000003.json").read_text())["split"] == k
    best = summary["eval_rl_best_val"]
    assert best["step"] == 3 and best == dict(json.loads((run_dir / "evals" / f"step_{best['step']:06d}.json")
                                                              .read_text()), step=best["step"],
                                                   val_solve_rate=best["val_solve_rate"],
                                                   val_reward_mean=best["val_reward_mean"], val_n=2)
    n_sft = len([r for r in recs if r["phase"] == "sft"])
    assert len([r for r in read_metrics(run_dir) if r["phase"] == "sft"]) == n_sft
    assert json.loads((run_dir / "state.json").read_text())["step"] == 3
    assert sorted(p.name for p in (run_dir / "samples").glob("*.jsonl")) == ["sft.jsonl"] + [
        f"step_{i:06d}.jsonl" for i in (1, 2, 3)]
    log = (run_dir / "log.txt").read_text()
    sft = (run_dir / "samples" / "sft.jsonl").read_bytes()  # SFT's input as trained on, named by its digest
    assert f"sha256 {hashlib.sha256(sft).hexdigest()[:16]}" in log
    n_ref = re.search(r"sft: (\d+) reference trajectories", log)[1]
    n_faults = re.search(r"sft faults: (\d+) of", log)[1]
    assert len(sft.splitlines()) == int(n_ref) + int(n_faults)  # the reference trajectories, then the fault replays
    assert "resumed at RL step 2" in log
    assert log.count("step 3: critic update") == 2  # the killed step was redone once, from its start


def test_boolean_flags_parse_false():
    assert train_t1.parse_args(["--async-rollout", "False"]).async_rollout is False
    assert train_t1.parse_args(["--async-rollout", "true"]).async_rollout is True


def test_megatron_backend_trains_the_same_loop(tmp_path, qwen35_sft):
    """--backend megatron (Qwen3.5 in Megatron-Core on this CPU: GatedDeltaNet, gated attention, gated shared
    expert) with Megatron's model parallel over 2 trainer ranks (--plan tp = 2: sequence parallel, vocab-parallel
    logprobs, DDP + distributed optimizer): same loop, R3 through RouterReplay, a gathered HF checkpoint for the
    engine, the trainer's old logprobs match the sampler's like the HF backend's; then a resume that reloads
    every rank's shards and adds exactly step 3. The SFT model is the embedded SFT's Qwen3.5 checkpoint, its
    vocabulary padded for tp = 2 (shared_runs.qwen35_sft: an SFT-only run with --backend megatron --plan tp 2),
    handed over as the cluster hands over its SFT model: --model-path. The run from --model-path in another layout
    is the next test (a test of its own: the two can run on two workers)."""
    run_dir = tmp_path / "run"
    flags = TINY + ["--run-dir", str(run_dir), "--backend", "megatron", "--eval-attempts", "0",  # eval: the hf e2e
                    "--rollout-actors", "1",  # two and their round robin: the hf e2e
                    "--plan", '{"tp": 2}', "--arch", "qwen3_5_moe",  # the cluster's architecture
                    "--model-path", str(qwen35_sft.ckpt)]
    train_t1.train(train_t1.parse_args(flags + ["--rl-steps", "2"]))
    rl = [r for r in read_metrics(run_dir) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2] and [r["staleness"] for r in rl] == [0, 1]
    assert all(np.isfinite(r["dlogp"]) and r["dlogp"] < 0.05 for r in rl if "dlogp" in r)
    assert any("dlogp" in r for r in rl)  # at least one step trained
    cfg = json.loads((run_dir / "ckpt" / "latest" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text"
    ck = __import__("torch").load(run_dir / "ckpt" / "latest" / "trainer_rank1.pt", weights_only=False)
    assert any(k.startswith("gpt.") for k in ck["critic"]) and ck["plan"]["tp"] == 2  # rank 1's Megatron critic
    assert "other trainer ranks pids [" in (run_dir / "log.txt").read_text()
    train_t1.train(train_t1.parse_args(flags + ["--rl-steps", "3"]))
    assert [r["step"] for r in read_metrics(run_dir) if r["phase"] == "rl"] == [1, 2, 3]


def test_megatron_backend_from_model_path_in_bf16_with_colocated_engines(tmp_path, qwen35_sft):
    """--model-path = an HF checkpoint (the one the embedded SFT wrote), no SFT of its own, every rank reading its
    shards of it, here in another layout (data x expert parallel over 2 ranks) and in the cluster presets' precision
    (bf16 parameters, fp32 master shards), the engines releasing their memory while the trainer works (--colocate,
    the one-node 35B preset: critic warm-up and update)."""
    run2 = tmp_path / "from_model_path"
    train_t1.train(train_t1.parse_args(TINY + [
        "--run-dir", str(run2), "--backend", "megatron", "--eval-attempts", "0", "--plan", '{"dp": 2, "ep": 2}',
        "--rollout-actors", "1",
        "--arch", "qwen3_5_moe", "--model-path", str(qwen35_sft.ckpt), "--rl-steps", "1",
        "--param-dtype", "bf16", "--colocate", "true", "--async-rollout", "false"]))  # and the 35B preset's colocation
    memory = [line.split("engines ", 1)[1] for line in (run2 / "log.txt").read_text().splitlines()
              if "] engines re" in line and "memory: " in line]
    assert memory == ["resume memory: weights, kv_cache",  # start: a no-op unless a kill left them released
                      # (then the SFT weights are reloaded from disk: step 0)
                      "release memory: kv_cache", "resume memory: kv_cache",  # critic warm-up
                      "release memory: weights, kv_cache", "resume memory: weights",  # step 1's update, its publish
                      "resume memory: kv_cache"], memory
    assert json.loads((run2 / "ckpt" / "latest" / "config.json").read_text())["dtype"] == "bfloat16"
    rows = read_metrics(run2)
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [1] and not any(r["phase"] == "sft" for r in rows)
    assert not (run2 / "ckpt" / "sft").exists()
    ck = __import__("torch").load(run2 / "ckpt" / "latest" / "trainer_rank1.pt", weights_only=False)
    assert ck["plan"]["ep"] == 2 and ck["plan"]["dp"] == 2
    assert any(m is not None and m.dtype == __import__("torch").float32 for m in ck["actor_opt"]["master"])
    rl = [r for r in rows if r["phase"] == "rl"]
    assert all(np.isfinite(r["dlogp"]) and r["dlogp"] < 0.05 for r in rl if "dlogp" in r)
