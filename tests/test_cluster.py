"""cluster/launch.py (presets, checks, SGLang client + weight publish) and daytona_sandbox.DaytonaSandbox, on CPU.

SGLang request bodies are checked two ways: against the embedded engine (engine/server.py) where the protocol
is shared, and, for the distributed weight update the embedded engine does not serve, against a small
HTTP server here that validates the bodies as SGLang's io_struct.py declares them (main at 001067f:
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, PauseGenerationReqInput) and
receives the broadcast tensors over a real gloo group, in a second process.
Daytona: the real SDK's create-params objects are built (skipped when `daytona` is not installed); the
sandbox's calls go to a fake client that implements the SDK's method names (the SDK has no offline mode).
"""
import contextlib
import json
import multiprocessing as mp
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from cluster import launch
import data
import model as model_lib
from sandbox import daytona
import rollout
from sandbox import task_io
from engine.server import EngineServer
from test_engine import get, post

# --- helpers: a validating fake SGLang server in its own process --------------------------------------
INIT_FIELDS = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int,
               "group_name": str, "backend": str}
UPDATE_FIELDS = {"names": list, "dtypes": list, "shapes": list, "group_name": str, "flush_cache": bool,
                 "abort_all_requests": bool, "weight_version": str, "load_format": str, "torch_empty_cache": bool}


def validate(body, fields, required):
    """SGLang's msgspec schema, strictly: known fields only, each of its declared type."""
    unknown = set(body) - set(fields)
    assert not unknown, f"fields SGLang does not declare: {unknown}"
    for k in required:
        assert k in body, f"missing required field {k}"
    for k, v in body.items():
        assert isinstance(v, fields[k]) and not (fields[k] is int and isinstance(v, bool)), (k, v)


def fake_sglang(port_q, result_q):
    """One fake engine of TP 1 (one receiving rank: rank_offset), gloo instead of NCCL."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    state = {"calls": [], "groups": None, "received": {}, "errors": []}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, obj):
            raw = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            try:
                if self.path == "/init_weights_update_group":
                    validate(body, INIT_FIELDS, ["master_address", "master_port", "rank_offset", "world_size"])
                    state["calls"].append(("init", body))
                    state["groups"] = launch.init_update_group(body["master_address"], body["master_port"],
                                                                body["rank_offset"], body["world_size"],
                                                                body["group_name"], body["backend"])
                    state["group_name"] = body["group_name"]
                elif self.path == "/update_weights_from_distributed":
                    validate(body, UPDATE_FIELDS, ["names", "dtypes", "shapes"])
                    assert len(body["names"]) == len(body["dtypes"]) == len(body["shapes"])
                    assert body["group_name"] == state["group_name"]
                    state["calls"].append(("update", body))
                    for name, dt, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                        assert all(isinstance(s, int) for s in shape), shape
                        t = torch.empty(shape, dtype=getattr(torch, dt))  # as SGLang: getattr(torch, dtype)
                        dist.broadcast(t, src=0, group=state["groups"])
                        assert name not in state["received"], f"{name} sent twice"
                        state["received"][name] = t.float().tolist()
                elif self.path == "/pause_generation":
                    assert body.get("mode", "abort") in ("abort", "retract", "in_place"), body
                    state["calls"].append(("pause", body))
                elif self.path == "/continue_generation":
                    state["calls"].append(("continue", body))
                elif self.path == "/destroy_weights_update_group":
                    state["calls"].append(("destroy", body))
                    result_q.put({"calls": state["calls"], "received": state["received"], "errors": state["errors"]})
                else:
                    raise AssertionError(f"unknown endpoint {self.path}")
                self._send({"success": True, "message": "ok"})
            except AssertionError as e:
                state["errors"].append(str(e))
                self._send({"success": False, "message": f"invalid request: {e}"})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    port_q.put(srv.server_address[1])
    srv.serve_forever()


@contextlib.contextmanager
def fake_sglang_server():
    """(url, result queue) of a fake_sglang in a spawned process, stopped on exit."""
    ctx = mp.get_context("spawn")
    port_q, result_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=fake_sglang, args=(port_q, result_q), daemon=True)
    proc.start()
    try:
        yield f"http://127.0.0.1:{port_q.get(timeout=120)}", result_q
    finally:
        proc.terminate()
        proc.join(10)


# --- SGLang client against the embedded engine (shared protocol) ---------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tok = model_lib.train_tokenizer(["ls -la /app\n", "cat file.txt | sort", "echo done"] * 20, vocab_size=300)
    path = str(tmp_path_factory.mktemp("ckpt"))
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=0), tok, path)
    eng = EngineServer(path, port=0, max_batch=4).start()
    yield eng, path, tok
    eng.stop()


def test_sglang_client_speaks_the_shared_protocol_of_the_embedded_engine(engine, tmp_path):
    eng, path, tok = engine
    c = launch.SGLangClient(eng.url)
    assert c.health()
    info = c.model_info()
    assert info["num_moe_layers"] == 4 and info["top_k"] == 2
    ids = tok.encode("ls -la", add_special_tokens=False)
    out = c.generate(ids, {"temperature": 0.0, "max_new_tokens": 4, "stop_token_ids": [2]})
    assert len(out["output_ids"]) == len(out["logprobs"]) <= 4
    assert out["routed_experts"].shape == (len(ids) + len(out["output_ids"]) - 1, 4, 2)
    # publish barrier with the disk path: pause (SGLang's body {"mode": "retract"}) -> update -> continue
    assert c.pause(mode="retract")["success"]
    c.update_weights_from_disk(path, weight_version=7)
    assert c.resume()["success"]
    assert c.model_info()["weight_version"] == "7"
    again = c.generate(ids, {"temperature": 0.0, "max_new_tokens": 2})
    assert again["weight_version"] == "7"


def test_sglang_server_command_has_routed_experts_and_token_io():
    cmd = launch.sglang_command("/m", 31000, tp=8)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init", "--trust-remote-code"):
        assert flag in cmd
    assert cmd[cmd.index("--tp-size") + 1] == "8" and cmd[cmd.index("--ep-size") + 1] == "8"
    assert cmd[cmd.index("--port") + 1] == "31000"


# --- bucketing and expert gathering ---------------------------------------------------------------------
def test_buckets_hold_every_weight_exactly_once_in_order_within_the_size():
    specs = [(f"w{i}", torch.bfloat16 if i % 2 else torch.float32, (i + 1, 16)) for i in range(20)]
    specs.append(("big", torch.bfloat16, (1000, 100)))  # 200 kB: larger than a bucket, goes alone
    cap = 2048
    buckets = launch.make_buckets(specs, cap)
    flat = [n for b in buckets for n, _, _ in b]
    assert flat == [n for n, _, _ in specs]  # every weight once, order kept
    for b in buckets:
        size = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in b)
        assert size <= cap or len(b) == 1
    assert buckets[-1] == [("big", torch.bfloat16, (1000, 100))]
    assert len(launch.make_buckets(specs, 1 << 40)) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        launch.make_buckets(specs, 0)


@pytest.mark.parametrize("ep,etp", [(1, 1), (4, 1), (2, 2)])
def test_gather_experts_rebuilds_every_expert_from_ep_and_etp_shards(ep, etp):
    E, ffn, h = 8, 6, 4
    full = {"gate_proj": torch.randn(E, ffn, h), "up_proj": torch.randn(E, ffn, h), "down_proj": torch.randn(E, h, ffn)}
    dims = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}  # ETP splits fc1 rows, fc2 columns

    def shard(kind, ep_r, etp_r):  # what EP rank ep_r, ETP rank etp_r holds of one kind
        return full[kind].chunk(ep, dim=0)[ep_r].chunk(etp, dim=dims[kind] + 1)[etp_r]

    def fake_all_gather(ep_r, etp_r):  # every rank's tensor of the same kind, in rank order
        def all_gather(t, group):
            for k in full:
                if group == "etp" and torch.equal(t, shard(k, ep_r, etp_r)):
                    return [shard(k, ep_r, j) for j in range(etp)]
                if group == "ep" and torch.equal(t, full[k].chunk(ep, dim=0)[ep_r]):
                    return [full[k].chunk(ep, dim=0)[j] for j in range(ep)]
            raise AssertionError(f"unexpected {group} gather of {tuple(t.shape)}")
        return all_gather

    for ep_r in range(ep):
        for etp_r in range(etp):
            local = {k: shard(k, ep_r, etp_r) for k in full}
            got = launch.gather_experts(local, ep_r, ep, fake_all_gather(ep_r, etp_r), etp, dims)
            for k in full:
                assert torch.equal(got[k], full[k])
    named = launch.expert_named_tensors(3, full, launch.hf_expert_name)
    assert len(named) == E * 3 and len({n for n, _ in named}) == E * 3
    assert named[0][0] == "model.layers.3.mlp.experts.0.gate_proj.weight"
    assert torch.equal(dict(named)["model.layers.3.mlp.experts.5.down_proj.weight"], full["down_proj"][5])


# --- the distributed publish end to end (gloo, a validating fake SGLang in a second process) -----------
def test_publish_barrier_sends_sglang_bodies_and_every_tensor_over_the_group():
    with fake_sglang_server() as (url, result_q):
        client = launch.SGLangClient(url, timeout=120)
        pub = launch.WeightPublisher([client], [1], "127.0.0.1", group_name="t1_test", backend="gloo",
                                      bucket_bytes=64 * 4)
        pub.connect()
        torch.manual_seed(0)
        weights = [("model.embed_tokens.weight", torch.randn(8, 4)),
                   ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.randn(6, 4)),
                   ("model.layers.0.mlp.experts.1.gate_proj.weight", torch.randn(6, 4)),
                   ("model.norm.weight", torch.randn(4).to(torch.bfloat16)),
                   ("lm_head.weight", torch.randn(20, 4))]  # 320 B: alone in its bucket
        n_buckets = pub.publish(weights, version=3)
        pub.close()
        res = result_q.get(timeout=120)
    assert res["errors"] == []
    kinds = [k for k, _ in res["calls"]]
    assert kinds == ["init", "pause"] + ["update"] * n_buckets + ["continue", "destroy"]
    init = res["calls"][0][1]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["group_name"] == "t1_test"
    assert res["calls"][1][1] == {"mode": "retract"}
    updates = [b for k, b in res["calls"] if k == "update"]
    assert n_buckets >= 3
    assert [u.get("weight_version") for u in updates] == [None] * (n_buckets - 1) + ["3"]
    assert sum((u["names"] for u in updates), []) == [n for n, _ in weights]
    assert "bfloat16" in sum((u["dtypes"] for u in updates), [])
    for name, t in weights:
        assert torch.equal(torch.tensor(res["received"][name]), t.float()), name


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
    p = launch.CLUSTER_PRESETS["qwen35-122b-a10b"]
    errs = launch.check_preset(p, {"DAYTONA_API_KEY": "k"}, H200, _model_dir(tmp_path),
                                packages={m: True for m in launch.PACKAGES})
    assert errs == []
    row, rows = launch.choose_plan(p)
    assert row is not None and row["feasible"] and row["tp"] * row["pp"] * row["cp"] * row["dp"] == p.train_gpus


def test_preset_check_refuses_with_a_clear_message_for_each_missing_piece(tmp_path):
    p = launch.CLUSTER_PRESETS["qwen35-122b-a10b"]
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
    for p in launch.CLUSTER_PRESETS.values():
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
    daytona = pytest.importorskip("daytona")
    task = _task(tmp_path, 'docker_image = "ghcr.io/laude/tb2-task:1"\nallow_internet = false\n')
    params = daytona.DaytonaSandbox(task, tmp_path / "trial").create_params()
    assert isinstance(params, daytona.CreateSandboxFromImageParams)
    assert params.image == "ghcr.io/laude/tb2-task:1"
    assert (params.resources.cpu, params.resources.memory, params.resources.disk) == (2, 3, 10)
    assert params.ephemeral and params.network_block_all and params.ttl_minutes == 6 + 30
    assert params.labels == {"t1-task": "task"}
    built = daytona.DaytonaSandbox(_task(tmp_path / "b"), tmp_path / "t2").create_params()
    assert isinstance(built.image, daytona.Image) and built.network_block_all is False  # from environment/Dockerfile
    snap = daytona.DaytonaSandbox(_task(tmp_path / "c"), tmp_path / "t3", snapshot="tb2-base").create_params()
    assert isinstance(snap, daytona.CreateSandboxFromSnapshotParams) and snap.snapshot == "tb2-base"


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
    c = launch.probe_config()
    with torch.device("meta"):  # no memory: only the parameter shapes
        m = Qwen3_5MoeForCausalLM(launch.hf_config(c))
    assert sum(p.numel() for p in m.parameters()) == infra.param_counts(c)["total"]
    assert m.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


# --- the cluster run's command line reaches train_t1.py ------------------------------------------------
def test_launch_command_parses_in_train_t1_and_fails_up_front_naming_what_is_missing(tmp_path, monkeypatch):
    import train_t1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "dtype": "bfloat16"}))
    with open(tmp_path / "model.safetensors", "wb") as f:  # sparse: the 122B's ~244 GB of bf16 weights
        f.truncate(244 * 10**9)
    preset = launch.CLUSTER_PRESETS["qwen35-122b-a10b"]
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
                                          (["--n-engines", "0"], "--engine-urls")])
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


def test_trainer_publishes_its_weights_under_hub_names_over_the_group(tmp_path):
    """ppo.Trainer with --engine-world-sizes: rank 0 of one group with the (fake) SGLang server; the
    server receives every weight under the checkpoint's names, bit-exact, then weight_version."""
    import ppo
    import train_t1
    tok = model_lib.train_tokenizer(["ls -la /app\n", "cat file.txt | sort"] * 20, vocab_size=300)
    path = str(tmp_path / "sft")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=0), tok, path)
    with fake_sglang_server() as (url, result_q):
        args = train_t1.parse_args(["--quick", "--run-dir", str(tmp_path / "run"), "--engine-urls", url,
                                    "--engine-world-sizes", "1"])
        trainer = ppo.Trainer(args, path, 0)
        trainer.connect_engines([url], [1], "127.0.0.1")
        trainer.publish(5)
        want = model_lib.hub_state_dict(trainer.actor)
        trainer.close()
        res = result_q.get(timeout=300)
    assert res["errors"] == []
    kinds = [k for k, _ in res["calls"]]
    assert kinds[:2] == ["init", "pause"] and kinds[-2:] == ["continue", "destroy"]
    updates = [b for k, b in res["calls"] if k == "update"]
    assert updates[-1]["weight_version"] == "5"
    assert set(res["received"]) == set(want) and "model.layers.0.mlp.experts.7.down_proj.weight" in want
    for name, t in want.items():
        assert torch.equal(torch.tensor(res["received"][name]), t.float()), name
    assert 5 in trainer.published


def test_the_embedded_engine_takes_a_publish_over_the_weight_group(tmp_path):
    """The cluster publish (cluster.WeightPublisher: SGLang's /init_weights_update_group and
    /update_weights_from_distributed, every tensor broadcast over one gloo group) into an embedded engine in its own
    process (`engine/server.py serve`): after ppo.Trainer publishes version 5 the engine's greedy reply and logprobs
    equal an engine loaded from the trainer's checkpoint on disk. A bucket naming a weight the model does not have is
    refused (400, naming it) with its tensors still received, so the group stays in step; a trainer that dies
    without leaving the group is replaced by one joining under the same name, whose publish applies."""
    import subprocess
    import sys
    import threading
    import torch.distributed as dist
    import infra
    import ppo
    import train_t1
    tok = model_lib.train_tokenizer(["ls -la /app\n", "cat file.txt | sort"] * 20, vocab_size=300)
    path = str(tmp_path / "sft")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=0), tok, path)
    port = infra.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", path, "--port", str(port),
                             "--weight-dtype", "fp32", "--threads", "1"], cwd=os.path.dirname(infra.__file__),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert "engine serving" in proc.stdout.readline()
        args = train_t1.parse_args(["--quick", "--run-dir", str(tmp_path / "run"), "--engine-urls", url,
                                    "--engine-world-sizes", "1"])
        trainer = ppo.Trainer(args, path, 0)
        with torch.no_grad():  # weights the engine does not have yet
            for p in trainer.actor.parameters():
                p.add_(0.01 * torch.randn_like(p))
        trainer.connect_engines([url], [1], "127.0.0.1")
        box = {}
        bucket = {"names": ["model.not_a_weight"], "dtypes": ["float32"], "shapes": [[3, 4]],
                  "group_name": trainer.publisher.group_name}
        t = threading.Thread(target=lambda: box.setdefault("res", post(url + "/update_weights_from_distributed",
                                                                       bucket)))
        t.start()
        dist.broadcast(torch.ones(3, 4), src=0, group=trainer.publisher.group)  # received though refused
        t.join(timeout=120)
        assert box["res"][0] == 400 and "model.not_a_weight" in box["res"][1]["error"], box
        # the trainer dies without /destroy_weights_update_group; its successor joins under the same group name
        dist.destroy_process_group(trainer.publisher.group)
        trainer.publisher.pool.shutdown(wait=False)
        trainer.connect_engines([url], [1], "127.0.0.1")
        trainer.publish(5)
        info = get(url + "/get_model_info")[1]
        assert info["weight_version"] == "5"
        trainer.save_actor(str(tmp_path / "pub"))
        ref = EngineServer(str(tmp_path / "pub"), port=0, max_batch=2, weight_dtype="fp32").start()
        try:
            body = {"input_ids": model_lib.render_ids(tok, "user", "ls"), "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
            a, b = (post(u + "/generate", body)[1] for u in (url, ref.url))
            assert a["output_ids"] == b["output_ids"]
            la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
            lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
            assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-5  # same weights; 1 vs 2 torch threads
        finally:
            ref.stop()
        trainer.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cluster_rehearsal_quick_runs_the_cluster_path_on_this_cpu(tmp_path):
    """`bash run.sh cluster-rehearsal --quick`: the embedded SFT writes a Qwen3.5 checkpoint, then cluster/launch.py
    launch (checks, the planner's plan for 4 devices, Ray, an embedded engine started by the launcher) runs train_t1
    with
    --model-path and --backend megatron over the plan's 4 gloo ranks, publishing over one process group; it prints
    the end-of-run table; a second launch on the same run directory resumes and adds exactly one step."""
    import subprocess
    root = os.path.dirname(os.path.abspath(launch.__file__))
    env = dict(os.environ, T1_REHEARSAL_SFT=str(tmp_path / "sft"), T1_REHEARSAL_RUN=str(tmp_path / "run"))
    env.pop("RAY_ADDRESS", None)
    flags = ["--n-train-tasks", "8", "--n-heldout-tasks", "3", "--n-launch", "5", "--n-keep", "4",
             "--critic-warmup-trials", "4", "--max-turns", "3", "--max-new-tokens", "48", "--rollout-workers", "5",
             "--minibatch-size", "2", "--eval-train-tasks", "2", "--eval-max-turns", "3"]

    def rehearse(steps):
        out = subprocess.run(["bash", "run.sh", "cluster-rehearsal", "--quick", *flags, "--rl-steps", str(steps)],
                             cwd=root, env=env, capture_output=True, text=True, timeout=1500)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout
    text = rehearse(1)
    assert json.loads((tmp_path / "sft" / "ckpt" / "sft" / "config.json").read_text())["model_type"] == \
        "qwen3_5_moe_text"
    assert "[cluster] chosen plan: tp=1 pp=1 cp=1 ep=4 etp=1 dp=4" in text and "| held-out | RL |" in text
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
    table = launch.gpu_check_table(res)
    print(table)
    rows = table.splitlines()
    assert len(rows) == 5 and all(r.count("|") == 4 for r in rows)
    assert "peak / predicted 1.07" in rows[2] and "MegatronAdam" in rows[2] and "1.10e-03" in rows[2]
    assert "OOM / boom" in rows[3] and "measured / predicted 1.11" in rows[4]
