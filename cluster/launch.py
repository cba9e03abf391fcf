"""The cluster launcher (paper: infrastructure): checks a preset before anything starts, lays out Ray, starts the
SGLang rollout servers and runs train_t1.py with their URLs and the planner's plan; also the one-GPU check.

T1 runs Qwen3.5-122B-A10B with a Megatron-Core trainer (actor and critic co-resident) and SGLang rollout servers
that return every token's routed experts (R3), acting in Daytona sandboxes. The presets are cluster/presets.py; the
weight publish from the trainer to the servers under the publish barrier is cluster/publish.py.

Run (from the repository root):
    python -m cluster.launch check  --preset qwen35-122b-a10b [--model-path DIR]   # up-front checks + the plan
    python -m cluster.launch launch --preset qwen35-122b-a10b [--model-path DIR] [-- train_t1.py flags]
    python -m cluster.launch sglang-cmd --preset qwen35-122b-a10b --model-path DIR  # the server command lines
    python -m cluster.launch gpu-check [--out DIR]          # one GPU: Megatron backend smoke + memory model check
    python -m cluster.launch launch --preset cpu-rehearsal --model-path DIR [-- flags]   # the same path on this CPU
                                                     # (bash run.sh cluster-rehearsal [--quick] makes DIR first)
`launch` = check (GPUs, env vars, model path, packages, a feasible plan) -> start or join Ray (RAY_ADDRESS) ->
placement groups (trainer GPUs packed, one bundle of `engine_tp` GPUs per SGLang server) -> SGLang servers as Ray
actors -> `train_t1.py` with the engine URLs and the chosen plan.

Departures from the paper:
 1. The launcher has not run on a cluster: its checks, layout and command line are tested on CPU
    (tests/test_cluster.py), and the CPU rehearsal runs its whole path.
 2. The CPU rehearsal (preset cpu-rehearsal) runs the launcher's path with the embedded engine in SGLang's place
    (its /update_weights_from_distributed takes the publish), bubblewrap in Daytona's, the Megatron trainer's
    local modules in fp32 over gloo ranks in place of TE + bf16 on GPUs; Ray and the planner are the real ones.
"""
import argparse
import sys

from cluster.presets import CLUSTER_PRESETS, CPU_PACKAGES, PACKAGES


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help line (a required flag has none to show)."""

    def _get_help_string(self, action):
        return action.help if action.required else super()._get_help_string(action)


def build_parser():
    """The command line (standard library only: --help answers before torch loads)."""
    fmt = _Help
    ap = argparse.ArgumentParser(prog="python -m cluster.launch", formatter_class=fmt, description=(
        "The cluster path: check a preset, start Ray and the SGLang rollout servers, run train_t1.py on them; or "
        "check one GPU."))
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    helps = {"check": "check a preset (GPUs, environment variables, model path, packages, a feasible plan) and "
                      "print the planner's plan",
             "launch": "check, start or join Ray, start the SGLang servers and run train_t1.py with their URLs and "
                       "the plan",
             "sglang-cmd": "print the command line of one SGLang server of the preset"}
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".", formatter_class=fmt)
        p.add_argument("--preset", required=True, choices=sorted(CLUSTER_PRESETS),
                       help="the cluster preset (cluster/presets.py)")
        p.add_argument("--model-path", default=None,
                       help="local Hugging Face copy of the preset's model; None: $T1_MODEL_PATH")
        p.add_argument("--run-dir", default=None, help="train_t1.py's run directory; None: runs/PRESET")
        p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: flags passed on to train_t1.py")
    text = ("one GPU: the trainer's cluster model, the memory model against the real allocation, the Megatron "
            "tests; a table at the end")
    g = sub.add_parser("gpu-check", help=text, description=text[0].upper() + text[1:] + ".", formatter_class=fmt)
    g.add_argument("--out", default=None,
                   help="directory for gpu_check.json, written as each check finishes; None: printed only")
    return ap


if __name__ == "__main__":
    ARGV = build_parser().parse_args()  # --help and bad flags answer here, before torch loads

import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from cluster import gpu_check  # noqa: E402
from engine import server  # noqa: E402
from engine.client import EngineClient  # noqa: E402
import infra  # noqa: E402


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
        client = EngineClient(url)
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
    preset: embedded engines (engine/server.py's EngineActor, the same HTTP contract, the publish over a gloo group)."""
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


# --- the train_t1.py command of a cluster run --------------------------------------------------------------
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
    """argv: the parsed command line (a Namespace) or a list of arguments (None: sys.argv)."""
    a = argv if isinstance(argv, argparse.Namespace) else build_parser().parse_args(argv)
    if a.cmd == "gpu-check":
        res = gpu_check.gpu_check(a.out)
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
    sys.exit(main(ARGV))
