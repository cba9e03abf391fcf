"""One tiny end-to-end run of the real pipeline: tasks -> SFT -> engine -> critic warm-up -> PPO -> eval,
then a resume of the same run directory that adds exactly one more RL step."""
import json

import numpy as np

import model as M
import rollout
import tito
import train_t1

TINY = ["--quick", "--n-train-tasks", "8", "--n-heldout-tasks", "3", "--n-launch", "5", "--n-keep", "4",
        "--critic-warmup-trials", "4", "--sft-epochs", "1", "--max-turns", "3", "--max-new-tokens", "48",
        "--rollout-workers", "5", "--minibatch-size", "2", "--eval-train-tasks", "2"]


def read_metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_tiny_pipeline_end_to_end_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    summary = train_t1.train(train_t1.parse_args(TINY + ["--run-dir", str(run_dir), "--rl-steps", "2"]))
    recs = read_metrics(run_dir)
    assert {r["phase"] for r in recs} == {"sft", "critic_warmup", "rl"}
    rl = [r for r in recs if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert rl[0]["n_launched"] == 5 and rl[0]["n_kept"] + rl[0]["n_dropped"] == 5 and rl[0]["n_kept"] <= 4
    assert [r["staleness"] for r in rl] == [0, 1]  # one-step async: step 2 was sampled while step 1 trained
    assert np.isfinite(rl[0]["dlogp"])
    assert 0.0 <= rl[0]["reward_mean"] <= 1.0
    for phase in ("eval_sft", "eval_rl"):
        assert summary[phase]["n_trials"] == 3 and 0.0 <= summary[phase]["solve_rate"] <= 1.0
    assert (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / "ckpt" / "latest" / "model.safetensors").exists()
    # critic before actor, observable in the log
    log = (run_dir / "log.txt").read_text()
    assert log.index("step 1: critic update") < log.index("step 1: actor update")
    # TITO samples on disk audit clean
    samples = tito.load_samples(run_dir / "samples" / "step_000001.jsonl")
    assert samples and tito.audit(samples)["loss_region_drift_pct"] == 0.0
    assert all(s["routed_experts"] is not None and s["routed_experts"].shape[0] == len(s["tokens"]) - 1 for s in samples)

    # resume: the same run dir with more steps continues at step 3, nothing repeated; this time against an
    # engine already running (--engine-urls, as cluster.py launch passes its SGLang servers)
    engine = M.EngineServer(str(run_dir / "ckpt" / "sft"), port=0).start()
    try:
        train_t1.train(train_t1.parse_args(TINY + ["--run-dir", str(run_dir), "--rl-steps", "3",
                                                   "--engine-urls", engine.url]))
        assert rollout.EngineClient(engine.url).model_info()["weight_version"] == "3"  # published after step 3
    finally:
        engine.stop()
    rl = [r for r in read_metrics(run_dir) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert rl[2]["weight_version"] == 3 and rl[2]["staleness"] == 0
    assert len([r for r in read_metrics(run_dir) if r["phase"] == "sft"]) == len([r for r in recs if r["phase"] == "sft"])


def test_boolean_flags_parse_false():
    assert train_t1.parse_args(["--async-rollout", "False"]).async_rollout is False
    assert train_t1.parse_args(["--async-rollout", "true"]).async_rollout is True


def test_megatron_backend_trains_the_same_loop(tmp_path):
    """--backend megatron (Qwen3.5 in Megatron-Core on this CPU: GatedDeltaNet, gated attention, gated shared
    expert) with Megatron's model parallel over 2 trainer ranks (--plan tp = 2: sequence parallel, vocab-parallel
    logprobs, DDP + distributed optimizer): same loop, R3 through RouterReplay, a gathered HF checkpoint for the
    engine, the trainer's old logprobs match the sampler's like the HF backend's; then a resume that reloads
    every rank's shards and adds exactly step 3."""
    run_dir = tmp_path / "run"
    flags = TINY + ["--run-dir", str(run_dir), "--backend", "megatron", "--eval-attempts", "0",  # eval: the hf e2e
                    "--plan", '{"tp": 2}']
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
