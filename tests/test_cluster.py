"""cluster/launch.py (presets, up-front checks, Ray layout, the SGLang and train_t1.py command lines, the CPU
rehearsal), cluster/gpu_check.py's probe model and table, and sandbox/daytona.py's DaytonaSandbox, on CPU.

Daytona: the real SDK's create-params objects are built (skipped when `daytona` is not installed); the
sandbox's calls go to a fake client that implements the SDK's method names (the SDK has no offline mode).
The weight publish is tests/test_publish.py.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from cluster import gpu_check
from cluster import launch
from cluster import presets
import data
import model as model_lib
import rollout
from sandbox import daytona
from sandbox import task_io
from shared_runs import qwen35_sft  # noqa: F401

def test_sglang_server_command_has_routed_experts_and_token_io():
    cmd = launch.sglang_command("/m", 31000, tp=8)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init", "--trust-remote-code"):
        assert flag in cmd
    assert cmd[cmd.index("--tp-size") + 1] == "8" and cmd[cmd.index("--ep-size") + 1] == "8"
    assert cmd[cmd.index("--port") + 1] == "31000"



# --- presets: up-front checks ---------------------------------------------------------------------------
H200 = [("NVIDIA H200", 143771.0)] * 8


def _model_dir(tmp_path, **over):
    d = tmp_path / "qwen"
    d.mkdir()
    cfg = {"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 48, "hidden_size": 3072,
                                                         "num_experts": 256, "num_experts_per_tok": 8, **over}}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    return str(d)


def test_preset_check_passes_when_everything_is_there(tmp_path):
    p = presets.CLUSTER_PRESETS["qwen35-122b-a10b"]
    errs = launch.check_preset(p, {"DAYTONA_API_KEY": "k"}, H200, _model_dir(tmp_path),
                                packages={m: True for m in presets.PACKAGES})
    assert errs == []
    row, rows = launch.choose_plan(p)
    assert row is not None and row["feasible"] and row["tp"] * row["pp"] * row["cp"] * row["dp"] == p.train_gpus


def test_preset_check_refuses_with_a_clear_message_for_each_missing_piece(tmp_path):
    p = presets.CLUSTER_PRESETS["qwen35-122b-a10b"]
    errs = launch.check_preset(p, {}, [("NVIDIA A100", 81920.0)] * 2, None,
                                packages={"sglang": False, "ray": True})
    text = "\n".join(errs)
    assert "DAYTONA_API_KEY is not set" in text
    assert "this node has 2 visible GPU(s)" in text and "needs 8 per node" in text
    assert "below 130 GiB" in text
    assert "--model-path" in text and "T1_MODEL_PATH" in text
    assert "packages: sglang not installed" in text and "requirements-cluster.txt" in text
    wrong = launch.check_preset(p, {"DAYTONA_API_KEY": "k", "T1_MODEL_PATH": _model_dir(tmp_path, num_experts=128)},
                                 H200, None, packages={})
    assert wrong == [f"model path: {tmp_path / 'qwen' / 'config.json'}: num_experts = 128, preset qwen35-122b-a10b "
                     f"expects 256"]
    assert "not a directory" in launch.check_preset(p, {"DAYTONA_API_KEY": "k"}, H200, str(tmp_path / "nope"),
                                                     packages={})[0]


def test_check_command_exits_listing_the_problems(monkeypatch, capsys):
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    monkeypatch.delenv("T1_MODEL_PATH", raising=False)
    with pytest.raises(SystemExit) as e:
        launch.main(["check", "--preset", "qwen35-35b-a3b"])
    assert "is not ready" in str(e.value) and "DAYTONA_API_KEY" in str(e.value)
    assert "chosen plan:" in capsys.readouterr().out  # the planner's choice is printed before refusing


def test_layout_bundles_cover_the_preset_and_keep_each_server_on_one_node():
    for p in presets.CLUSTER_PRESETS.values():
        lay = {role: bundles for _, roles in launch.layout(p) for role, bundles in roles.items()}
        if p.device == "cpu":  # the rehearsal: the engines' CPU bundles; train_t1 places its trainer ranks
            assert list(lay) == ["engines"] and all("GPU" not in b for b in lay["engines"])
            continue
        train, engines = lay["train"], lay["engines"]
        gpus = sum(b.get("GPU", 0) for b in train + engines)
        assert gpus == (p.train_gpus if p.colocate else p.train_gpus + p.n_engines * p.engine_tp) <= p.gpus
        assert all(b.get("GPU", 0) <= p.gpus_per_node for b in engines)


# --- Daytona sandbox ------------------------------------------------------------------------------------
def _task(tmp_path, env_extra=""):
    d = tmp_path / "task"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text("pytest --ctrf /logs/verifier/ctrf.json /tests/test_x.py\n")
    (d / "tests" / "test_x.py").write_text("def test_a():\n    assert True\n")
    (d / "instruction.md").write_text("Do it.\n")
    (d / "task.toml").write_text('[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 300.0\n'
                                 f'[environment]\ncpus = 2\nmemory_mb = 3072\nstorage_mb = 10240\n{env_extra}')
    return task_io.load_task(str(d))


class FakeDaytona:
    """The SDK surface DaytonaSandbox uses: Daytona.create(params, timeout) -> Sandbox with .process.exec,
    .fs.upload_files / .fs.download_file, .delete(). Commands are recorded; replies are scripted."""

    def __init__(self, fail_on=None, pane=("",), files=None):
        self.created, self.deleted, self.cmds, self.uploads = [], 0, [], []
        self.fail_on, self.panes, self.files = fail_on, list(pane), files or {}

    def create(self, params, timeout=60):
        self.created.append((params, timeout))
        fake = self

        class Proc:
            def exec(self, command, cwd=None, env=None, timeout=None):
                fake.cmds.append((command, env, timeout))
                if fake.fail_on and fake.fail_on in command:
                    return SimpleNamespace(exit_code=1, result="boom")
                if "capture-pane" in command:
                    return SimpleNamespace(exit_code=0, result=fake.panes.pop(0) if fake.panes else "")
                return SimpleNamespace(exit_code=0, result="ok\n")

        class FS:
            def upload_files(self, files):
                fake.uploads += [(f.source, f.destination) for f in files]

            def download_file(self, path):
                if path not in fake.files:
                    raise FileNotFoundError(path)
                return fake.files[path]

        class Box:
            id = "sb-1"
            process, fs = Proc(), FS()

            def delete(self):
                fake.deleted += 1
        return Box()


def test_daytona_create_params_are_the_sdks_own_objects(tmp_path):
    sdk = pytest.importorskip("daytona")  # the SDK (the module `daytona` here is sandbox/daytona.py)
    task = _task(tmp_path, 'docker_image = "ghcr.io/laude/tb2-task:1"\nallow_internet = false\n')
    params = daytona.DaytonaSandbox(task, tmp_path / "trial").create_params()
    assert isinstance(params, sdk.CreateSandboxFromImageParams)
    assert params.image == "ghcr.io/laude/tb2-task:1"
    assert (params.resources.cpu, params.resources.memory, params.resources.disk) == (2, 3, 10)
    assert params.ephemeral and params.network_block_all and params.ttl_minutes == 6 + 30
    assert params.labels == {"t1-task": "task"}
    built = daytona.DaytonaSandbox(_task(tmp_path / "b"), tmp_path / "t2").create_params()
    assert isinstance(built.image, sdk.Image) and built.network_block_all is False  # from environment/Dockerfile
    snap = daytona.DaytonaSandbox(_task(tmp_path / "c"), tmp_path / "t3", snapshot="tb2-base").create_params()
    assert isinstance(snap, sdk.CreateSandboxFromSnapshotParams) and snap.snapshot == "tb2-base"


def test_daytona_sandbox_terminal_exec_and_verifier_through_the_sdk_calls(tmp_path, monkeypatch):
    pytest.importorskip("daytona")
    ctrf = {"results": {"tool": {"name": "pytest"}, "summary": {"tests": 2, "passed": 1, "failed": 1},
                        "tests": [{"name": "a", "status": "passed"}, {"name": "b", "status": "failed"}]}}
    fake = FakeDaytona(pane=["$ ", "$ ls\nfile.txt\n$ "], files={"/logs/verifier/ctrf.json": json.dumps(ctrf).encode()})
    task = _task(tmp_path)
    with daytona.DaytonaSandbox(task, tmp_path / "trial", client=fake) as box:
        assert fake.created and any("tmux new-session -d -s t1" in c for c, _, _ in fake.cmds)
        assert box.read(0) == "$ "
        box.send_keys("ls\n")
        assert "tmux send-keys -t t1 -l ls" in fake.cmds[-1][0] and "send-keys -t t1 Enter" in fake.cmds[-1][0]
        box.send_keys("C-c")
        assert fake.cmds[-1][0].endswith("tmux send-keys -t t1 C-c'")
        assert box.read(0) == "ls\nfile.txt\n$ "  # only the new part of the pane
        rc, out = box.exec("echo hi", timeout=5)
        assert (rc, out) == (0, "ok\n") and fake.cmds[-1][2] == 5
        v = box.run_verifier()
    assert sorted(d for _, d in fake.uploads) == ["/tests/test.sh", "/tests/test_x.py"]
    assert fake.cmds[-1][1] == {"PYTEST_ADDOPTS": "-p no:cacheprovider"} and fake.cmds[-1][2] == 60
    assert v["source"] == "ctrf" and v["passed"] == 1
    assert fake.deleted == 1  # closed on exit


def test_daytona_sandbox_is_deleted_on_every_exit_path(tmp_path, monkeypatch):
    pytest.importorskip("daytona")
    task = _task(tmp_path)
    fake = FakeDaytona(fail_on="tmux new-session")  # start fails after the sandbox exists
    with pytest.raises(RuntimeError, match="tmux"):
        daytona.DaytonaSandbox(task, tmp_path / "t1", client=fake).start()
    assert fake.deleted == 1
    fake = FakeDaytona()
    with pytest.raises(KeyError):
        with daytona.DaytonaSandbox(task, tmp_path / "t2", client=fake):
            raise KeyError("agent crashed")
    assert fake.deleted == 1
    box = daytona.DaytonaSandbox(task, tmp_path / "t3", client=fake).start()
    assert box in daytona._DAYTONA_OPEN
    daytona._close_open_daytona()  # the atexit hook
    assert fake.deleted == 2 and box not in daytona._DAYTONA_OPEN
    box.close()  # idempotent
    assert fake.deleted == 2
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="DAYTONA_API_KEY is not set"):
        daytona.DaytonaSandbox(task, tmp_path / "t4").start()


def test_gpu_check_probe_model_has_exactly_the_parameters_the_memory_model_counts():
    from transformers import Qwen3_5MoeForCausalLM
    import infra
    c = gpu_check.probe_config()
    with torch.device("meta"):  # no memory: only the parameter shapes
        m = Qwen3_5MoeForCausalLM(gpu_check.hf_config(c))
    assert sum(p.numel() for p in m.parameters()) == infra.param_counts(c)["total"]
    assert m.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


# --- the cluster run's command line reaches train_t1.py ------------------------------------------------
def test_launch_command_parses_in_train_t1_and_fails_up_front_naming_what_is_missing(tmp_path, monkeypatch):
    import train_t1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "dtype": "bfloat16"}))
    with open(tmp_path / "model.safetensors", "wb") as f:  # sparse: the 122B's ~244 GB of bf16 weights
        f.truncate(244 * 10**9)
    preset = presets.CLUSTER_PRESETS["qwen35-122b-a10b"]
    row = {"tp": 2, "pp": 1, "cp": 1, "ep": 64, "etp": 1, "dp": 32, "recompute": True}
    cmd = launch.train_command(preset, "runs/x", str(tmp_path), ["http://a:1", "http://b:2"], row, ["--rl-steps", "3"])
    args = train_t1.parse_args(cmd[2:])
    assert ((args.backend, args.sandbox, args.rl_steps, args.n_launch, args.n_keep)
            == ("megatron", "daytona", 3, 560, 512))
    assert args.engine_urls == "http://a:1,http://b:2" and json.loads(args.plan)["ep"] == 64
    assert args.engine_world_sizes == ",".join(["8"] * preset.n_engines)
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    with pytest.raises(ValueError, match="engine-world-sizes"):  # 8 servers in the preset, 2 URLs here
        train_t1.check_args(args)
    args = train_t1.parse_args(cmd[2:] + ["--engine-world-sizes", "8,8"])
    with pytest.raises(ValueError, match="DAYTONA_API_KEY"):
        train_t1.check_args(args)
    monkeypatch.setenv("DAYTONA_API_KEY", "k")
    assert args.param_dtype == "bf16"  # the cluster's precision
    if not torch.cuda.is_available():  # a CPU trainer cannot hold it (bf16 + fp32 masters + moments); GPUs can
        with pytest.raises(ValueError, match="30 bytes a parameter.*train it on GPU nodes"):
            train_t1.check_args(args)


@pytest.mark.parametrize("flags, match", [(["--sandbox", "docker"], "--sandbox"), (["--backend", "jax"], "--backend"),
                                          (["--n-keep", "9", "--n-launch", "5"], "--n-keep"),
                                          (["--model-path", "/nonexistent"], "--model-path"),
                                          (["--n-engines", "0"], "--engine-urls"),
                                          (["--stop-after", "rl"], "--stop-after"),
                                          (["--stop-after", "sft", "--model-path", "."], "--stop-after")])
def test_bad_flags_are_refused_naming_the_flag(flags, match):
    import train_t1
    with pytest.raises(ValueError, match=match):
        train_t1.check_args(train_t1.parse_args(["--quick"] + flags))


def test_run_trial_selects_the_daytona_sandbox(tmp_path, monkeypatch):
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    task = data.generate_tasks(tmp_path / "tasks", 1, 0, seed=0, validate_tasks=False)[0][0]
    res = rollout.run_trial(task, "nop", sandbox="daytona")
    assert res["exit_reason"] == "error" and "DaytonaSandbox: DAYTONA_API_KEY is not set" in res["error"]
    res = rollout.run_trial(task, "nop", sandbox="lxc")
    assert res["exit_reason"] == "error" and "sandbox: expected bwrap|daytona" in res["error"]


def test_sft_only_run_stops_at_its_checkpoint(qwen35_sft):
    """`bash run.sh cluster-rehearsal --sft-only` (train_t1.py --stop-after sft, the rehearsal's SFT command): the
    embedded SFT writes a Qwen3.5 HF checkpoint, logs that it stops there, and starts no Ray actor, engine,
    evaluation, critic warm-up or RL step."""
    run_dir = qwen35_sft.run_dir
    assert json.loads((qwen35_sft.ckpt / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert (qwen35_sft.ckpt / "model.safetensors").exists()
    log = (run_dir / "log.txt").read_text()
    assert f"stop after sft: the SFT checkpoint is {qwen35_sft.ckpt}" in log.rstrip().splitlines()[-1]  # the end
    assert "ray actors:" not in log and "critic warm-up" not in log
    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == 0 and "sft" in state["phase_times"] and "critic_warmup" not in state
    phases = {json.loads(x)["phase"] for x in open(run_dir / "metrics.jsonl")}
    assert phases == {"sft"}  # --base-steps 0: SFT's rows only
    assert not (run_dir / "summary.json").exists() and not (run_dir / "ckpt" / "latest").exists()


def test_sft_only_command_is_the_rehearsals_sft_command(qwen35_sft):
    """The shared checkpoint is built by run.sh's own rehearsal SFT step (its flags + --sft-only), which runs
    train_t1.py with --stop-after sft; run.sh skips that step when T1_REHEARSAL_SFT holds a checkpoint."""
    assert qwen35_sft.cmd[:4] == ["bash", "run.sh", "cluster-rehearsal", "--sft-only"]
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(launch.__file__))), "run.sh")).read()
    assert '--arch qwen3_5_moe --run-dir "$sft" --stop-after sft' in text
    assert 'if [ ! -f "$sft/ckpt/sft/config.json" ]' in text


def test_cluster_rehearsal_quick_runs_the_cluster_path_on_this_cpu(tmp_path, qwen35_sft):
    """`bash run.sh cluster-rehearsal --quick`: the embedded SFT's Qwen3.5 checkpoint (shared_runs.qwen35_sft,
    written by this command's own SFT step; given in T1_REHEARSAL_SFT, so not written again), then `python -m
    cluster.launch launch` (checks, the planner's plan for 4 devices, Ray, an embedded engine started by the
    launcher) runs train_t1 with --model-path and --backend megatron over the plan's 4 gloo ranks, publishing over
    one process group; it prints the end-of-run table; a second launch on the same run directory resumes and adds
    exactly one step."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(launch.__file__)))  # the repository root
    sft_log = (qwen35_sft.run_dir / "log.txt").read_text()
    env = dict(os.environ, T1_REHEARSAL_SFT=str(qwen35_sft.run_dir), T1_REHEARSAL_RUN=str(tmp_path / "run"))
    env.pop("RAY_ADDRESS", None)
    # the pools of tests/test_e2e.py's TINY (one generation for both with the suite's task cache); the evaluation
    # on held-out tasks only (the table's held-out rows), a warm-up pool of one minibatch
    flags = ["--n-train-tasks", "8", "--n-heldout-tasks", "3", "--n-launch", "5", "--n-keep", "4",
             "--critic-warmup-trials", "2", "--max-turns", "3", "--max-new-tokens", "48", "--rollout-workers", "5",
             "--minibatch-size", "2", "--eval-train-tasks", "0", "--eval-max-turns", "3",
             "--rollout-actors", "1"]  # two rollout actors: tests/test_e2e.py

    def rehearse(steps):
        out = subprocess.run(["bash", "run.sh", "cluster-rehearsal", "--quick", *flags, "--rl-steps", str(steps)],
                             cwd=root, env=env, capture_output=True, text=True, timeout=1500)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout
    text = rehearse(1)
    assert (qwen35_sft.run_dir / "log.txt").read_text() == sft_log  # the SFT step was skipped
    assert "[cluster] chosen plan: tp=1 pp=1 cp=1 ep=4 etp=1 dp=4" in text and "| test (in-template) | RL |" in text
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "publish: over one process group to engine ranks [1]" in log
    pids = log.split("other trainer ranks pids [")[1].split("]")[0]
    assert len(pids.split(",")) == 3  # 4 trainer ranks
    args = json.loads((tmp_path / "run" / "args.json").read_text())
    assert (args["backend"], args["sandbox"], json.loads(args["plan"])["ep"]) == ("megatron", "bwrap", 4)
    rehearse(2)
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [1, 2]


def test_the_rehearsal_model_shape_is_the_embedded_qwen35():
    """infra.MODEL_SHAPES["t1-tiny"] (what the planner sizes for the rehearsal) = model.tiny_config's Qwen3.5."""
    import infra
    c, t = infra.MODEL_SHAPES["t1-tiny"], model_lib.tiny_config(2048, "qwen3_5_moe")
    assert (c.n_layers, c.hidden, c.n_experts, c.top_k, c.moe_ffn, c.shared_ffn, c.vocab) == (
        t.num_hidden_layers, t.hidden_size, t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size,
        t.shared_expert_intermediate_size, t.vocab_size)
    assert (c.n_gdn, c.n_attn) == (t.layer_types.count("linear_attention"), t.layer_types.count("full_attention"))
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim) == (
        t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.linear_num_key_heads, t.linear_num_value_heads,
        t.linear_key_head_dim, t.linear_value_head_dim)


def test_gpu_check_table_shows_each_kind_of_check():
    """gpu-check's short table (it runs only on a GPU; its formatting is checked here on the shapes it gets)."""
    res = {"checks": [
        {"name": "trainer bench t1-tiny", "ok": True, "result": {
            "steps": [{"seconds": 3.1, "tokens_per_s": 600.0, "dlogp": 1.1e-3, "dlogp_r3_off": 1.9e-3}],
            "peak_over_predicted": 1.07, "transformer_impl": "transformer_engine", "dispatcher": "flex",
            "optimizer": "MegatronAdam"}},
        {"name": "trainer bench 122b-slice", "ok": False, "result": None, "tail": "Traceback ...\nOOM | boom"},
        {"name": "static bytes", "ok": True, "measured": 10, "predicted": 9, "ratio": 1.11}]}
    table = gpu_check.gpu_check_table(res)
    print(table)
    rows = table.splitlines()
    assert len(rows) == 5 and all(r.count("|") == 4 for r in rows)
    assert "peak / predicted 1.07" in rows[2] and "MegatronAdam" in rows[2] and "1.10e-03" in rows[2]
    assert "OOM / boom" in rows[3] and "measured / predicted 1.11" in rows[4]
