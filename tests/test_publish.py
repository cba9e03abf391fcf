"""cluster/publish.py on CPU: the SGLang client and the weight publish under the publish barrier.

SGLang request bodies are checked two ways: against the embedded engine (engine/server.py) where the protocol
is shared, and, for the distributed weight update the embedded engine does not serve, against a small
HTTP server here that validates the bodies as SGLang's io_struct.py declares them (main at 001067f:
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, PauseGenerationReqInput) and
receives the broadcast tensors over a real gloo group, in a second process. The trainer's publish and the embedded
engine's side of it run end to end over that group.
"""
import contextlib
import json
import multiprocessing as mp
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from cluster import publish
import infra
import model as model_lib
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
                    state["groups"] = infra.init_update_group(body["master_address"], body["master_port"],
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
    c = publish.SGLangClient(eng.url)
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


# --- bucketing and expert gathering ---------------------------------------------------------------------
def test_buckets_hold_every_weight_exactly_once_in_order_within_the_size():
    specs = [(f"w{i}", torch.bfloat16 if i % 2 else torch.float32, (i + 1, 16)) for i in range(20)]
    specs.append(("big", torch.bfloat16, (1000, 100)))  # 200 kB: larger than a bucket, goes alone
    cap = 2048
    buckets = publish.make_buckets(specs, cap)
    flat = [n for b in buckets for n, _, _ in b]
    assert flat == [n for n, _, _ in specs]  # every weight once, order kept
    for b in buckets:
        size = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in b)
        assert size <= cap or len(b) == 1
    assert buckets[-1] == [("big", torch.bfloat16, (1000, 100))]
    assert len(publish.make_buckets(specs, 1 << 40)) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        publish.make_buckets(specs, 0)


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
            got = publish.gather_experts(local, ep_r, ep, fake_all_gather(ep_r, etp_r), etp, dims)
            for k in full:
                assert torch.equal(got[k], full[k])
    named = publish.expert_named_tensors(3, full, publish.hf_expert_name)
    assert len(named) == E * 3 and len({n for n, _ in named}) == E * 3
    assert named[0][0] == "model.layers.3.mlp.experts.0.gate_proj.weight"
    assert torch.equal(dict(named)["model.layers.3.mlp.experts.5.down_proj.weight"], full["down_proj"][5])


# --- the distributed publish end to end (gloo, a validating fake SGLang in a second process) -----------
def test_publish_barrier_sends_sglang_bodies_and_every_tensor_over_the_group():
    with fake_sglang_server() as (url, result_q):
        client = publish.SGLangClient(url, timeout=120)
        pub = publish.WeightPublisher([client], [1], "127.0.0.1", group_name="t1_test", backend="gloo",
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


def test_trainer_publishes_its_weights_under_hub_names_over_the_group(tmp_path):
    """trainer.Trainer with --engine-world-sizes: rank 0 of one group with the (fake) SGLang server; the
    server receives every weight under the checkpoint's names, bit-exact, then weight_version."""
    import trainer as trainer_lib
    import train_t1
    tok = model_lib.train_tokenizer(["ls -la /app\n", "cat file.txt | sort"] * 20, vocab_size=300)
    path = str(tmp_path / "sft")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=0), tok, path)
    with fake_sglang_server() as (url, result_q):
        args = train_t1.parse_args(["--quick", "--run-dir", str(tmp_path / "run"), "--engine-urls", url,
                                    "--engine-world-sizes", "1"])
        trainer = trainer_lib.Trainer(args, path, 0)
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
    """The cluster publish (publish.WeightPublisher: SGLang's /init_weights_update_group and
    /update_weights_from_distributed, every tensor broadcast over one gloo group) into an embedded engine in its own
    process (`engine/server.py serve`): after trainer.Trainer publishes version 5 the engine's greedy reply and logprobs
    equal an engine loaded from the trainer's checkpoint on disk. A bucket naming a weight the model does not have is
    refused (400, naming it) with its tensors still received, so the group stays in step; a trainer that dies
    without leaving the group is replaced by one joining under the same name, whose publish applies."""
    import subprocess
    import sys
    import threading
    import torch.distributed as dist
    import trainer as trainer_lib
    import train_t1
    tok = model_lib.train_tokenizer(["ls -la /app\n", "cat file.txt | sort"] * 20, vocab_size=300)
    path = str(tmp_path / "sft")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=0), tok, path)
    proc = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", path, "--port", "0",
                             "--weight-dtype", "fp32", "--threads", "1"], cwd=os.path.dirname(infra.__file__),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert "engine serving" in line, line
        url = line.strip().rsplit(" at ", 1)[1]  # the port the kernel gave it (--port 0)
        args = train_t1.parse_args(["--quick", "--run-dir", str(tmp_path / "run"), "--engine-urls", url,
                                    "--engine-world-sizes", "1"])
        trainer = trainer_lib.Trainer(args, path, 0)
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
