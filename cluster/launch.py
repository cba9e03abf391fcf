"""Cluster path (paper section "infrastructure"): presets, up-front checks, Ray layout, SGLang servers,
and the weight publish from the trainer to the engines under the publish barrier.

T1 runs Qwen3.5-122B-A10B with a Megatron-Core trainer (actor and critic co-resident) and SGLang rollout servers
that return every token's routed experts (R3), acting in Daytona sandboxes. After each PPO step the trainer
publishes the new actor weights: pause generation, push them to every engine over NCCL, resume (DESIGN.md
section 3, step 7). The SGLang HTTP bodies followed are listed above `WeightPublisher`.

Run:
    python -m cluster.launch check  --preset qwen35-122b-a10b [--model-path DIR]   # up-front checks + the plan
    python -m cluster.launch launch --preset qwen35-122b-a10b [--model-path DIR] [-- train_t1.py flags]
    python -m cluster.launch sglang-cmd --preset qwen35-122b-a10b --model-path DIR  # the server command lines
    python -m cluster.launch gpu-check [--out DIR]          # one GPU: Megatron backend smoke + memory model check
    python -m cluster.launch launch --preset cpu-rehearsal --model-path DIR [-- flags]   # the same path on this CPU
                                                     # (bash run.sh cluster-rehearsal [--quick] makes DIR first)
`launch` = check (GPUs, env vars, model path, packages, a feasible plan) -> start or join Ray (RAY_ADDRESS) ->
placement groups (trainer GPUs packed, one bundle of `engine_tp` GPUs per SGLang server) -> SGLang servers as Ray
actors -> `train_t1.py` with the engine URLs and the chosen plan.

Departures (numbered, with why):
 1. Node counts are ours: 122B on 16 nodes x 8 GPUs (64 trainer GPUs, 8 SGLang servers of TP = EP = 8); the
    one-node 35B preset colocates trainer and engine (the engine releases its memory), so it runs synchronously.
 2. Pause mode "retract": in-flight requests resume after the push with their KV cache recomputed ("abort" would cut
    the agent's turn, "in_place" cannot flush the cache); each token's logprob is still from the weights that
    sampled it, which is what PPO's ratio needs.
 3. Experts are published one by one in Hugging Face names (SGLang maps them onto its fused tensors), gathered over
    EP (and ETP) first; the names come from cluster/mcore_weights.py's converter.
 4. The trainer joins the weight group with SGLang's `init_custom_process_group` when sglang is importable, else an
    equivalent from torch.distributed internals (the CPU tests, gloo).
 5. Nothing here has run on a GPU or a cluster yet (RESULTS.md): the request bodies are checked against SGLang's
    schemas and the publish protocol end to end over gloo on CPU (tests/test_cluster.py).
 6. The CPU rehearsal (preset cpu-rehearsal) runs the launcher's path with the embedded engine in SGLang's place
    (its /update_weights_from_distributed takes the publish), bubblewrap in Daytona's, the Megatron trainer's
    local modules in fp32 over gloo ranks in place of TE + bf16 on GPUs; Ray and the planner are the real ones.
"""
import argparse
import concurrent.futures as cf
import dataclasses
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time

from engine import server
import infra
import rollout


# --- presets ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ClusterPreset:
    name: str
    model: str
    """infra.MODEL_SHAPES key (the memory model's architecture)"""
    hf_repo: str
    """Hugging Face repo of the weights (named in messages only: nothing is downloaded)"""
    nodes: int
    gpus_per_node: int
    train_gpus: int
    """W of the trainer's plan (actor and critic co-resident on the same W GPUs)"""
    engine_tp: int
    """GPUs per SGLang server (TP = EP inside the server, one node)"""
    n_engines: int
    tokens: int = 16384
    """T: tokens per device per micro-batch (infra.py's planner)"""
    mem_gib: float = 95.0
    """M: per-device budget of each network (paper: ~95 GiB each, co-resident)"""
    gpu_mem_gib: float = 130.0
    """smallest GPU memory accepted (H200: 141 GB = 131 GiB reported by nvidia-smi as ~143771 MiB)"""
    colocate: bool = False
    """engines share the trainer's GPUs (release their memory while the trainer runs)"""
    env_vars: tuple = ("DAYTONA_API_KEY",)
    model_path_env: str = "T1_MODEL_PATH"
    device: str = "gpu"
    """gpu: SGLang servers, Daytona, GPUs; cpu: the rehearsal (embedded engines, bubblewrap, gloo trainer ranks)"""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


CLUSTER_PRESETS = {
    "qwen35-122b-a10b": ClusterPreset("qwen35-122b-a10b", "qwen35-122b-a10b", "Qwen/Qwen3.5-122B-A10B",
                                      nodes=16, gpus_per_node=8, train_gpus=64, engine_tp=8, n_engines=8),
    "qwen35-35b-a3b": ClusterPreset("qwen35-35b-a3b", "qwen35-35b-a3b", "Qwen/Qwen3.5-35B-A3B",
                                    nodes=1, gpus_per_node=8, train_gpus=8, engine_tp=8, n_engines=1,
                                    colocate=True, tokens=8192),  # T = 16384 fits no plan once the behaviour
    # copy of the actor is counted (infra.py: best 100.6 GiB > M = 95; 93.8 GiB at T = 8192)
    # the whole cluster path on this CPU: 4 gloo trainer ranks ("devices") under the planner's plan, one embedded
    # engine taking the publish over a gloo group, bubblewrap jails; its model is the embedded SFT's checkpoint
    "cpu-rehearsal": ClusterPreset("cpu-rehearsal", "t1-tiny", "(a checkpoint written by the embedded SFT)",
                                   nodes=1, gpus_per_node=0, train_gpus=4, engine_tp=1, n_engines=1, tokens=4096,
                                   mem_gib=6.0, gpu_mem_gib=0.0, env_vars=(), device="cpu"),  # M: the memory
    # model's fixed 4 GiB a device (CUDA context, buffers) is counted on the CPU too
}
CPU_PACKAGES = {"megatron.core": "megatron-core", "ray": "ray"}  # what the rehearsal needs beyond requirements.txt
PACKAGES = {"sglang": "sglang", "megatron.core": "megatron-core", "ray": "ray", "daytona": "daytona",
            "transformer_engine": "transformer-engine"}


# --- up-front checks -------------------------------------------------------------------------------
def gpu_inventory():
    """[(name, memory MiB)] of this node's GPUs from nvidia-smi; [] when there is none."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, mib = line.rpartition(",")
        try:
            gpus.append((name.strip(), float(mib)))
        except ValueError:
            continue
    return gpus


def check_model_path(path, preset):
    """Problems with a model directory (HF layout of the preset's architecture); [] when fine."""
    if not path:
        return [f"model path: not given; pass --model-path DIR or set {preset.model_path_env} to a local copy "
                f"of {preset.hf_repo} (Hugging Face layout: config.json + *.safetensors)"]
    if not os.path.isdir(path):
        return [f"model path: {path!r} is not a directory (expected a local copy of {preset.hf_repo})"]
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return [f"model path: no config.json in {path!r}"]
    errs = []
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        errs.append(f"model path: no *.safetensors in {path!r}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return errs + [f"model path: {cfg_path}: unreadable ({e})"]
    want = infra.MODEL_SHAPES[preset.model]
    text = cfg.get("text_config", cfg)  # Qwen3.5 checkpoints nest the language model under text_config
    for key, expect in (("num_hidden_layers", want.n_layers), ("hidden_size", want.hidden),
                        ("num_experts", want.n_experts), ("num_experts_per_tok", want.top_k)):
        if key in text and text[key] != expect:
            errs.append(f"model path: {cfg_path}: {key} = {text[key]}, preset {preset.name} expects {expect}")
    return errs


def check_preset(preset, env, gpus, model_path, packages=None):
    """Everything a preset needs, checked before anything starts -> list of problems ([] = ready).

    env: mapping of environment variables; gpus: gpu_inventory() of this node; packages: {module: bool}
    (None = look them up). Pure apart from the package lookup and the model directory.
    """
    errs = []
    for var in preset.env_vars:
        if not env.get(var):
            errs.append(f"env: {var} is not set (Daytona sandboxes: create a key at app.daytona.io and "
                        f"`export {var}=...`)")
    cpu = preset.device == "cpu"  # the rehearsal: no GPUs to count, the packages of requirements.txt
    need = preset.gpus_per_node
    if not cpu and len(gpus) < need:
        errs.append(f"GPUs: this node has {len(gpus)} visible GPU(s), preset {preset.name} needs {need} per node "
                    f"on {preset.nodes} node(s) ({preset.gpus} in all)")
    small = [f"{n} ({mib / 1024:.0f} GiB)" for n, mib in gpus if mib / 1024 < preset.gpu_mem_gib]
    if small:
        errs.append(f"GPUs: {len(small)} GPU(s) below {preset.gpu_mem_gib:g} GiB: {small[0]}; the memory model "
                    f"budgets M = {preset.mem_gib:g} GiB per network per device (H200-class GPUs)")
    errs += check_model_path(model_path or env.get(preset.model_path_env), preset)
    wanted = CPU_PACKAGES if cpu else PACKAGES
    packages = packages if packages is not None else {m: importlib.util.find_spec(m.split(".")[0]) is not None
                                                      for m in wanted}
    missing = [wanted.get(m, m) for m, ok in packages.items() if not ok]
    if missing:
        errs.append(f"packages: {', '.join(missing)} not installed; " + ("requirements.txt" if cpu else
                    "`pip install -r requirements-cluster.txt` on every node (DeepEP: see that file)"))
    if not cpu and (preset.train_gpus > preset.gpus or (not preset.colocate and preset.train_gpus
                                                        + preset.n_engines * preset.engine_tp > preset.gpus)):
        errs.append(f"preset {preset.name}: trainer {preset.train_gpus} + engines "
                    f"{preset.n_engines}x{preset.engine_tp} GPUs exceed {preset.gpus}")
    return errs


def choose_plan(preset, seq_len=0):
    """(first feasible row of infra.py's planner or None, all rows) for the trainer's W GPUs. On GPUs only plans the
    CUDA trainer runs: cp = 1 (cluster/cp_gdn.py's context-parallel Gated DeltaNet is CPU only; mcore.trainer_layout
    refuses it on CUDA); a row it cannot run is marked infeasible with that reason."""
    rows = infra.plan_table(infra.MODEL_SHAPES[preset.model], preset.train_gpus, preset.tokens, preset.mem_gib, seq_len)
    if preset.device != "cpu":
        for r in rows:
            if r["feasible"] and r["cp"] > 1:
                r.update(feasible=False, reason="cp > 1: not written for the CUDA trainer")
    feas = [r for r in rows if r["feasible"]]
    return (feas[0] if feas else None), rows


def print_plan(preset, row, rows):
    print(f"[cluster] {preset.name}: {preset.nodes} node(s) x {preset.gpus_per_node} GPUs; trainer W = "
          f"{preset.train_gpus}, T = {preset.tokens} tokens/device, M = {preset.mem_gib:g} GiB; "
          f"{preset.n_engines} SGLang server(s) x {preset.engine_tp} GPUs"
          + (" (colocated)" if preset.colocate else ""))
    feas = [r for r in rows if r["feasible"]]
    print(infra.format_table(feas, top=5, tokens=preset.tokens))
    if row is None:
        print(f"[cluster] no feasible plan among {len(rows)} valid ones (see `python infra.py plan --preset "
              f"{preset.model} --gpus {preset.train_gpus} --all`)")
    else:
        print("[cluster] chosen plan: " + " ".join(f"{k}={row[k]}" for k in ("tp", "pp", "cp", "ep", "etp", "dp",
                                                                                "recompute")))


def require_ready(preset, model_path):
    """Run the checks; exit with every problem listed (one per line) when something is missing."""
    errs = check_preset(preset, os.environ, gpu_inventory(), model_path)
    row, rows = choose_plan(preset)
    if row is None:
        errs.append(f"plan: no parallel plan fits M = {preset.mem_gib:g} GiB per device on {preset.train_gpus} GPUs")
    print_plan(preset, row, rows)
    if errs:
        raise SystemExit(f"[cluster] preset {preset.name} is not ready:\n" + "\n".join(f"  - {e}" for e in errs))
    return row


# --- Ray layout ------------------------------------------------------------------------------------
def layout(preset):
    """The preset's placement groups in infra.ray_placement's form: the trainer's GPUs packed onto the fewest nodes,
    one bundle per SGLang server (a bundle never spans nodes, so each server sits on one node). The CPU preset: the
    engines' bundles only (train_t1 places its own trainer ranks)."""
    if preset.device == "cpu":
        return [("PACK", {"engines": [{"CPU": 1} for _ in range(preset.n_engines)]})]
    train = [{"GPU": 1, "CPU": 4} for _ in range(preset.train_gpus)]
    if preset.colocate:  # engines run inside the trainer's bundles' GPUs: no GPUs of their own
        engines = [{"CPU": 4} for _ in range(preset.n_engines)]
    else:
        engines = [{"GPU": preset.engine_tp, "CPU": 8} for _ in range(preset.n_engines)]
    return [("PACK", {"train": train}), ("PACK" if preset.colocate else "SPREAD", {"engines": engines})]


def ray_connect(preset, timeout_s=600):
    """Join RAY_ADDRESS, or start a head on this node; wait until the preset's GPUs have joined. The CPU preset
    starts Ray in this process (infra.ray_start) and gives train_t1 its address."""
    if preset.device == "cpu":
        ray = infra.ray_start(preset.train_gpus + preset.n_engines + 2, os.environ.get("RAY_ADDRESS", ""), 1)
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # train_t1 joins this Ray
        return ray
    import ray
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        try:
            ray.init(address="auto")
        except (ConnectionError, RuntimeError):
            subprocess.run(["ray", "start", "--head", "--disable-usage-stats"], check=True)
            ray.init(address="auto")
    head = ray.util.get_node_ip_address()
    deadline = time.time() + timeout_s
    while True:
        have = int(ray.cluster_resources().get("GPU", 0))
        if have >= preset.gpus:
            return ray
        if time.time() > deadline:
            raise SystemExit(f"[cluster] Ray has {have} GPUs after {timeout_s} s, preset {preset.name} needs "
                             f"{preset.gpus}; on every other node run: ray start --address={head}:6379")
        print(f"[cluster] waiting for GPUs: {have}/{preset.gpus}; on the other nodes: "
              f"ray start --address={head}:6379", flush=True)
        time.sleep(15)


# --- SGLang servers --------------------------------------------------------------------------------
def sglang_command(model_path, port, tp, ep=None, host="0.0.0.0", mem_fraction=0.8, context_length=None,
                   extra=()):
    """`python -m sglang.launch_server ...` for one rollout server."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", host, "--port", str(port),
           "--tp-size", str(tp), "--ep-size", str(ep or tp),  # experts spread over the server's GPUs
           "--enable-return-routed-experts",  # R3: top-k expert ids of every token in meta_info
           "--skip-tokenizer-init",  # TITO: token ids in, token ids out; no detokenized text round trip
           "--mem-fraction-static", f"{mem_fraction:g}", "--dtype", "bfloat16", "--trust-remote-code"]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    return cmd + list(extra)


class SGLangServer:
    """One SGLang server process; run as a Ray actor (`ray.remote(num_gpus=tp)(SGLangServer)`), or locally."""

    def __init__(self, model_path, tp, log_dir, mem_fraction=0.8, context_length=None, extra=()):
        self.port, self.proc = infra.free_port(host=""), None
        self.cmd = sglang_command(model_path, self.port, tp, mem_fraction=mem_fraction,
                                  context_length=context_length, extra=extra)
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"sglang-{socket.gethostname()}-{self.port}.log")

    def start(self, timeout_s=3600):
        """Start the process (GPUs: the CUDA_VISIBLE_DEVICES Ray gave this actor) -> its URL once healthy."""
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url, deadline = self.url(), time.time() + timeout_s
        client = rollout.EngineClient(url)
        while not client.health():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited with code {self.proc.returncode}; see {self.log_path}")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"sglang not healthy after {timeout_s} s; see {self.log_path}")
            time.sleep(5)
        return url

    def url(self):
        try:
            import ray
            host = ray.util.get_node_ip_address()
        except ImportError:
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # the process group we started (start_new_session), by pid
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def start_engines(ray, preset, place, model_path, log_dir):
    """SGLang servers as Ray actors, one per engine bundle (place: infra.ray_placement's) -> (actors, urls); the CPU
    preset: embedded engines (engine.EngineActor, the same HTTP contract, the publish over a gloo group)."""
    if preset.device == "cpu":
        actors = [ray.remote(server.EngineActor).options(**place["engines"][i]).remote(model_path, "bf16", 1)
                  for i in range(preset.n_engines)]
        return actors, [info["url"] for info in ray.get([a.info.remote() for a in actors])]
    actors = []
    for i in range(preset.n_engines):
        if preset.colocate:  # share the trainer's GPUs: no GPU reservation, all of the node's devices visible
            opts = dict(num_gpus=0, runtime_env={"env_vars": {
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",  # Ray would hide every GPU from num_gpus=0
                "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(preset.engine_tp))}})
        else:
            opts = dict(num_gpus=preset.engine_tp)
        actor = ray.remote(SGLangServer).options(scheduling_strategy=place["engines"][i]["scheduling_strategy"],
                                                 **opts).remote(
            model_path, preset.engine_tp, log_dir, mem_fraction=0.4 if preset.colocate else 0.8)
        actors.append(actor)
    urls = ray.get([a.start.remote() for a in actors])
    return actors, urls


class SGLangClient(rollout.EngineClient):
    """rollout.EngineClient plus the endpoints only SGLang serves (distributed weight update, memory)."""

    def pause(self, mode="retract"):
        """Publish barrier, first half (departure 2: retract, not abort)."""
        return self._call("/pause_generation", {"mode": mode})

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        out = self._call("/init_weights_update_group", {
            "master_address": str(master_address), "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})
        return _ok(out, "/init_weights_update_group")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        weight_version=None, flush_cache=True):
        body = {"names": list(names), "dtypes": [dtype_name(d) for d in dtypes],
                "shapes": [[int(s) for s in shape] for shape in shapes], "group_name": group_name,
                "flush_cache": bool(flush_cache)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return _ok(self._call("/update_weights_from_distributed", body), "/update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name="weight_update_group"):
        return self._call("/destroy_weights_update_group", {"group_name": group_name})


def _ok(out, path):
    if not out.get("success", False):
        raise RuntimeError(f"engine {path}: {out.get('message') or out}")
    return out


def dtype_name(dtype) -> str:
    """torch.bfloat16 / "torch.bfloat16" / "bfloat16" -> "bfloat16" (SGLang does getattr(torch, name))."""
    return str(dtype).replace("torch.", "")


# --- weight publish: gather experts, bucket, broadcast under the barrier -----------------------------
def make_buckets(specs, bucket_bytes):
    """Split [(name, dtype, shape)] into consecutive buckets of at most bucket_bytes (a larger tensor goes
    alone); every weight exactly once, order kept (the engine receives in this order)."""
    import torch
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
    buckets, cur, size = [], [], 0
    for name, dtype, shape in specs:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, dtype, tuple(shape)))
        size += n
    if cur:
        buckets.append(cur)
    return buckets


def gather_experts(local, ep_rank, ep_size, all_gather, etp_size=1, etp_dims=None):
    """One layer's expert weights gathered from every EP (and ETP) rank.

    local: {kind: tensor (E_local, ...)}, the experts [ep_rank*E_local, (ep_rank+1)*E_local) of this
    rank (kind e.g. "gate_proj", "up_proj", "down_proj"). all_gather(tensor, group) -> list of the
    tensors of every rank in rank order; group is "ep" or "etp". etp_dims: {kind: dim of the ETP
    split within one expert} (fc1: output rows 0, fc2: input columns 1). -> {kind: tensor (E, ...)}.
    """
    import torch
    out = {}
    for kind, t in local.items():
        if etp_size > 1:
            d = (etp_dims or {}).get(kind)
            if d is None:
                raise ValueError(f"etp_dims: no split dim for {kind!r} with ETP {etp_size}")
            t = torch.cat(all_gather(t, "etp"), dim=d + 1)  # +1: dim 0 is the local expert index
        parts = all_gather(t, "ep") if ep_size > 1 else [t]
        if len(parts) != ep_size:
            raise RuntimeError(f"gather_experts: {len(parts)} shards for EP {ep_size}")
        out[kind] = torch.cat(parts, dim=0)  # (E_local * EP, ...) in expert order
    return out


def expert_named_tensors(layer, gathered, name_fn):
    """{kind: (E, ...)} -> [(hf name, tensor of one expert)] in expert-major order."""
    n_exp = {t.shape[0] for t in gathered.values()}
    if len(n_exp) != 1:
        raise ValueError(f"expert_named_tensors: kinds disagree on the expert count {sorted(n_exp)}")
    return [(name_fn(layer, e, kind), gathered[kind][e]) for e in range(n_exp.pop()) for kind in gathered]


def hf_expert_name(layer, expert, kind):
    """Hugging Face (Qwen3.5-MoE) name of one expert projection, as SGLang's loader expects."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{kind}.weight"


init_update_group = infra.init_update_group  # (infra.py: the embedded engine joins such a group too)


# SGLang API followed (HTTP bodies; read from sgl-project/sglang python/sglang/srt/managers/io_struct.py, main branch
# at commit 001067f; the paper pins v0.5.12.post1, whose fields these are a subset of):
#   POST /init_weights_update_group       {master_address, master_port, rank_offset, world_size, group_name,
#                                          backend}                                    -> {success, message}
#   POST /update_weights_from_distributed {names, dtypes ("bfloat16"), shapes, group_name, flush_cache,
#                                          weight_version?}                            -> {success, message}
#   POST /destroy_weights_update_group    {group_name}
#   POST /pause_generation                {mode: "abort" | "retract" | "in_place"};  POST /continue_generation {}
#   POST /release_memory_occupation, /resume_memory_occupation {tags?}     (colocated preset only)
# After the HTTP call for a bucket is issued, each engine rank receives `broadcast(tensor, src=0)` on the group for
# every name in order; the trainer (rank 0 of the group) broadcasts the same tensors.
class WeightPublisher:
    """Trainer rank 0's side of the publish: one NCCL group with every engine rank, then per publish
    pause -> buckets (HTTP metadata to every engine, broadcast of each tensor) -> resume. The trainer's publish
    interface, with rollout.DiskPublisher (the embedded engines load the checkpoint from disk)."""
    wants_weights = True  # publish broadcasts the tensors it is given

    def __init__(self, clients, engine_world_sizes, master_address, master_port=None,
                 group_name="t1_weight_update", backend="nccl", bucket_bytes=infra.GiB):
        if len(clients) != len(engine_world_sizes):
            raise ValueError("engine_world_sizes: one entry per client")
        self.clients, self.sizes = list(clients), [int(s) for s in engine_world_sizes]
        self.master_address, self.master_port = master_address, master_port or infra.free_port(host="")
        self.group_name, self.backend, self.bucket_bytes = group_name, backend, bucket_bytes
        self.group = None
        self.pool = cf.ThreadPoolExecutor(max_workers=max(len(self.clients), 1))

    def connect(self):
        """POST /init_weights_update_group to every engine while this process joins as rank 0."""
        world = 1 + sum(self.sizes)
        offsets = [1 + sum(self.sizes[:i]) for i in range(len(self.sizes))]  # engine i: ranks [off, off+size)
        futs = [self.pool.submit(c.init_weights_update_group, self.master_address, self.master_port, off, world,
                                 self.group_name, self.backend) for c, off in zip(self.clients, offsets)]
        self.group = init_update_group(self.master_address, self.master_port, 0, world, self.group_name,
                                       self.backend)
        for f in futs:
            f.result()
        return self

    def push(self, named_tensors, version):
        """Send [(name, tensor)] in buckets; the last bucket carries weight_version. Call under pause()."""
        import torch.distributed as dist
        tensors = dict(named_tensors)
        if len(tensors) != len(named_tensors):
            raise ValueError("push: duplicate weight names")
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in named_tensors]
        buckets = make_buckets(specs, self.bucket_bytes)
        for i, bucket in enumerate(buckets):
            names, dtypes, shapes = zip(*bucket)
            v = version if i == len(buckets) - 1 else None
            futs = [self.pool.submit(c.update_weights_from_distributed, names, dtypes, shapes, self.group_name, v)
                    for c in self.clients]
            for name in names:  # each engine rank receives these, in this order
                dist.broadcast(tensors[name].contiguous(), src=0, group=self.group)
            for f in futs:
                f.result()
        return len(buckets)

    def publish(self, named_tensors, version):
        """Publish barrier: pause every engine, push version `version`, resume (always, even on error)."""
        for c in self.clients:
            c.pause()
        try:
            return self.push(named_tensors, version)
        finally:
            for c in self.clients:
                c.resume()

    def close(self):
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self.group_name)
            except RuntimeError:
                pass
        if self.group is not None:
            import torch.distributed as dist
            dist.destroy_process_group(self.group)
            self.group = None
        self.pool.shutdown(wait=False)


# --- GPU check ---------------------------------------------------------------------------------------
def probe_config():
    """A small member of the Qwen3.5-MoE family for one GPU (infra.ModelConfig)."""
    return infra.ModelConfig("probe", n_layers=4, hidden=1024, n_experts=16, top_k=4, moe_ffn=512, shared_ffn=512,
                             n_gdn=3, n_attn=1, vocab=32768, n_heads=8, n_kv_heads=2, head_dim=128,
                             lin_k_heads=4, lin_v_heads=8, lin_k_dim=128, lin_v_dim=128)


def hf_config(c):
    from transformers import Qwen3_5MoeTextConfig
    every = c.n_layers // c.n_attn
    return Qwen3_5MoeTextConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.n_layers,
        layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(c.n_layers)],
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        linear_num_key_heads=c.lin_k_heads, linear_num_value_heads=c.lin_v_heads, linear_key_head_dim=c.lin_k_dim,
        linear_value_head_dim=c.lin_v_dim, linear_conv_kernel_dim=c.conv_kernel, num_experts=c.n_experts,
        num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_ffn, shared_expert_intermediate_size=c.shared_ffn,
        router_aux_loss_coef=0.0, tie_word_embeddings=c.tie_embeddings, max_position_embeddings=65536)


def measure_static(c, device="cuda"):
    """Bytes of Megatron's mixed-precision layout for c on one device, allocated for real: bf16 weights,
    fp32 main grads, fp32 master + Adam m, v (distributed optimizer at W = 1)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(hf_config(c)).to(torch.bfloat16)
    params = [p for p in model.parameters()]
    grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    master = [p.detach().float() for p in params]
    m, v = [torch.zeros_like(x) for x in master], [torch.zeros_like(x) for x in master]
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated() - base
    return model, static, (grads, master, m, v)


def gpu_check_table(res) -> str:
    """gpu_check's result as a short markdown table: each check, ok, its figure."""
    lines = ["| check | ok | figure |", "|---|---|---|"]
    for ch in res["checks"]:
        r = ch.get("result") or {}
        if "ratio" in ch:
            fig = f"measured / predicted {ch['ratio']:.2f}"
        elif r.get("steps"):
            first, last = r["steps"][0], r["steps"][-1]
            fig = (f"peak / predicted {r.get('peak_over_predicted')}, step {last['seconds']} s "
                   f"({last['tokens_per_s']} tok/s), abs dlogp {first['dlogp']:.2e} "
                   f"(R3 off {first['dlogp_r3_off']:.2e}), "
                   f"{r.get('transformer_impl')} / {r.get('dispatcher')} / {r.get('optimizer')}")
        else:
            fig = str(ch.get("error") or ch.get("tail") or "")[-100:].replace("\n", " ").replace("|", "/")
        lines.append(f"| {ch['name']} | {ch.get('ok')} | {fig} |")
    return "\n".join(lines)


def gpu_check(out_dir=None, tokens=(2048, 4096)):
    """One GPU: (0) the trainer's cluster model (`train_t1.py trainer-bench`, tiny and a 122B-width slice: bf16,
    Megatron's distributed optimizer, TE / DeepEP where they import, real train_steps with R3 replay, peak memory vs
    infra's prediction); (1) infra.py's predicted vs measured bytes: the static terms (params + grads + optimizer)
    on the real allocation, and activations (no recompute) from peak - static of one forward + backward of the HF
    model (torch reference GDN path, not FLA); (2) tests/test_mcore_te.py with the GPU visible and the Megatron CPU
    suite tests/test_mcore.py with it hidden, the slowest last.
    Each check is printed and written to OUT/gpu_check.json as it finishes, so a run cut off by the device's time
    limit still returns what it measured."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("[gpu-check] no CUDA device visible")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": []}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

    def done(check):
        if "ratio" in check:
            check["ok"] = 0.5 <= check["ratio"] <= 2.0  # the memory model is a planning tool: same order, not exact
        res["checks"].append(check)
        print(f"[gpu-check] {json.dumps(check, default=str)[:3000]}", flush=True)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
                f.write(json.dumps(res, indent=1, default=str))

    # the cluster model in the trainer (issue 16): ppo.Trainer's Megatron path on this GPU, bf16 + Megatron's
    # distributed optimizer (+ TE / DeepEP where they import), a few real train_steps with R3 replay of the HF
    # model's routing; its peak memory against infra's prediction. First: the check that matters most.
    for shape, tokens_, samples, limit in (("t1-tiny", 512, 4, 150), ("122b-slice", 1024, 2, 330)):
        name = f"trainer bench {shape} (bf16, cluster preset)"
        try:
            r = subprocess.run([sys.executable, "train_t1.py", "trainer-bench", "--shape", shape, "--tokens",
                                str(tokens_), "--samples", str(samples), "--steps", "3", "--preset",
                                "qwen35-122b-a10b"], cwd=here, capture_output=True, text=True, timeout=limit)
            out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
            done({"name": name, "ok": r.returncode == 0, "result": out,
                  "tail": None if out else (r.stdout + r.stderr)[-3000:]})
        except Exception as e:  # a failure or timeout is reported (with its output so far); the checks below still run
            part = getattr(e, "stderr", None) or b""
            done({"name": name, "ok": False, "error": repr(e)[-300:],
                  "tail": (part.decode(errors="replace") if isinstance(part, bytes) else part)[-3000:] or None})
    c, plan = probe_config(), infra.Plan(1, 1, 1, 1, 1, 1, recompute=False)
    try:
        model, static, _keep = measure_static(c)
        pred = infra.device_memory(c, plan, tokens[0], "actor", overhead_gib=0.0)
        pred_static = pred["params"] + pred["grads"] + pred["optimizer"] + pred["expert_optimizer"]
        done({"name": "static bytes (bf16 + fp32 grads + 12 B/param)", "measured": static,
              "predicted": pred_static, "ratio": static / pred_static})
        for T in tokens:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            ids = torch.randint(0, c.vocab, (1, T), device="cuda")
            loss = model(input_ids=ids, labels=ids).loss
            peak_fwd = torch.cuda.max_memory_allocated() - before
            loss.backward()
            model.zero_grad(set_to_none=True)
            pred = infra.device_memory(c, plan, T, "actor", overhead_gib=0.0)
            done({"name": f"activations T={T} (HF torch path, no recompute)", "measured": peak_fwd,
                  "predicted": pred["activations"], "ratio": peak_fwd / pred["activations"]})
            del loss, ids
        del model, _keep
        torch.cuda.empty_cache()
    except Exception as e:
        done({"name": "memory model", "ok": False, "error": repr(e)[-1500:]})
    # test_mcore_te.py with the GPU visible (T1_TEST_GPU=1: its TE test needs one); test_mcore.py is the CPU suite
    # (models built with CPU initialisation, which Megatron moves to a visible GPU: the first GPU run's failure), so
    # it runs as tests/conftest.py runs it by default, the GPU hidden: the suite on this node's torch and Megatron-Core
    for name, test, limit, env in (("mcore TE layout (GPU)", "tests/test_mcore_te.py", 240, {"T1_TEST_GPU": "1"}),
                                   ("mcore pytest (CPU suite, GPU hidden)", "tests/test_mcore.py", 420, {})):
        if not os.path.isfile(os.path.join(here, test)):
            continue
        try:  # own process (its NCCL group); a failure or timeout is reported, the checks after it still run
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-x", test], cwd=here,
                               capture_output=True, text=True, timeout=limit, env={**os.environ, **env})
            ok = False if r.returncode else None if "skipped" in r.stdout else True  # skipped: not checked here
            done({"name": name, "ok": ok, "tail": (r.stdout + r.stderr)[-3000:]})
        except Exception as e:
            done({"name": name, "ok": False, "error": repr(e)[-500:]})
    print(json.dumps(res, indent=1, default=str))
    print(gpu_check_table(res))
    return res


def train_command(preset, run_dir, model_path, urls, row, extra=()):
    """The train_t1.py command line of a cluster run: the preset, the SGLang URLs and the planner's plan (the CPU
    preset: the embedded preset's values, bubblewrap jails, the plan's ranks as gloo trainer ranks)."""
    plan = {k: row[k] for k in ("tp", "pp", "cp", "ep", "etp", "dp", "recompute")}
    cpu = preset.device == "cpu"
    return [sys.executable, "train_t1.py", "--preset", "embedded" if cpu else preset.name, "--run-dir", run_dir,
            "--model-path", model_path, "--backend", "megatron", "--param-dtype", "bf16",  # the cluster's precision
            "--sandbox", "bwrap" if cpu else "daytona",
            "--engine-urls", ",".join(urls),
            "--engine-world-sizes", ",".join([str(preset.engine_tp)] * preset.n_engines),
            "--plan", json.dumps(plan), *(["--trainer-ranks", str(row["tp"] * row["pp"] * row["cp"] * row["dp"])]
                                          if cpu else []), *extra]


# --- CLI ---------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("check", "launch", "sglang-cmd"):
        p = sub.add_parser(name)
        p.add_argument("--preset", required=True, choices=sorted(CLUSTER_PRESETS))
        p.add_argument("--model-path", default=None, help="local HF copy of the preset's model ($T1_MODEL_PATH)")
        p.add_argument("--run-dir", default=None)
        p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: passed to train_t1.py")
    g = sub.add_parser("gpu-check")
    g.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "gpu-check":
        res = gpu_check(a.out)
        return 0 if all(ch.get("ok") is not False for ch in res["checks"]) else 1
    preset = CLUSTER_PRESETS[a.preset]
    model_path = a.model_path or os.environ.get(preset.model_path_env)
    if a.cmd == "sglang-cmd":
        print(" ".join(sglang_command(model_path or "MODEL_PATH", 30000, preset.engine_tp)))
        return 0
    row = require_ready(preset, model_path)
    if a.cmd == "check":
        print(f"[cluster] preset {preset.name}: ready")
        return 0
    run_dir = a.run_dir or f"runs/{preset.name}"
    ray = ray_connect(preset)
    _, place = infra.ray_placement(layout(preset))  # the launcher's groups stay for the run (its Ray session)
    actors, urls = start_engines(ray, preset, place, model_path, os.path.join(run_dir, "logs"))
    print(f"[cluster] SGLang servers up: {urls}", flush=True)
    cmd = train_command(preset, run_dir, model_path, urls, row, [x for x in a.train_args if x != "--"])
    print("[cluster] " + " ".join(cmd), flush=True)
    try:
        return subprocess.call(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        ray.get([x.stop.remote() for x in actors])


if __name__ == "__main__":
    sys.exit(main())
