"""Infrastructure (paper section "infrastructure"): the closed-form memory model b(Pi, T) and the planner that picks
the sharding before initialisation (Proposition 7.1), and the Ray layout of one-step async (where the trainer,
engine and rollout-worker actors go; the workers and the publish barrier are in rollout.py). The context-parallel
Gated DeltaNet operator is cluster/cp_gdn.py.

    python infra.py plan --preset qwen35-122b-a10b --gpus 64 [--tokens 16384] [--mem-gib 95] [--json] [--all]

Memory model. A plan Pi = (TP, PP, CP, EP, ETP, DP) on W = TP*PP*CP*DP devices (Megatron-Core's "MoE parallel
folding": the expert layers re-fold the same TP*CP*DP ranks of a stage as EP x ETP x EDP, so EDP = TP*CP*DP /
(EP*ETP)). Per device, for one network (actor or critic):

    params     = 2  * (P_dense_stage / TP + P_router_stage + P_exp / (PP*EP*ETP))        bf16
    grads      = 4  * (same count)                       fp32 main grads (Megatron's distributed
                                                         optimizer table: "bf16 param, fp32 grads")
    optimizer  = 12 * P_dense_stage / TP / (DP*CP)       fp32 master + Adam m, v; sharded over DP x CP
    expert_opt = 12 * P_exp / (PP*EP*ETP) / EDP  =  12 * P_exp / W                  (Proposition 7.1)
    behaviour  = 2  * (params count)     actor only: the behaviour policy's bf16 copy (trainer.Trainer.behaviour:
                                         the weights that sampled the batch, version t-1, for the old logprobs)
    host       = 2 * 2 * (params count)  actor only, host memory, not in b: the two published versions (t-1, t)
                                         Trainer.mark_published keeps, as slime's TensorBackuper keeps its snapshots
    activ.     = T tokens per device per micro-batch (slime's --max-tokens-per-gpu); 1F1B keeps PP
                 micro-batches in flight on stage 0 (1 on the last stage, which also holds the logits)
                   no recompute:   n_flight * sum_layers a_layer(T)          + logits
                   full recompute: n_flight * L_stage * 2h*T/SP + max a_layer(T) + logits
    total      = sum of the above + fixed overhead (CUDA context, NCCL/DeepEP buffers, fragmentation)

b(Pi, T) = max over {first, last} pipeline stage. A plan is feasible when b <= M for the actor AND for the critic
separately (paper: both co-resident, each within ~95 GiB per device on its own). Proposition 7.1: since
PP*EP*ETP*EDP = PP*TP*CP*DP = W, expert optimizer bytes per device are 12 * P_exp / W whatever the plan;
`expert_optimizer` is computed from the local shard, not from the closed form, so the test checks the proposition.

Departures (numbered, with why):
 1. Activation bytes are a tensor count of the Megatron/FLA path (`layer_activation_bytes`), not a profile; expert
    load balance is assumed perfect (EP does not change MoE activations).
 2. Dense parameters are counted as TP-sharded except the router (replicated); norms are /TP (tiny).
 3. Only layer counts divisible by PP (no uneven or virtual pipeline stages); vocab padding ignored.
 4. Attention under CP is modelled like the rest (1/CP tokens); the transient all-gathered K/V is ignored.
 5. Model sizes: Qwen3.5's published layout without the MTP head and vision tower; the 122B preset assumes 32 query /
    2 KV heads of dim 256 and 16 key / 64 value GDN heads of dim 128 (35B: 16/2 and 16/32, transformers' defaults).
 6. T is tokens per device per micro-batch, so a trajectory of up to CP*T tokens fits one; `--seq-len S` rejects
    plans with CP*T < S. Grads are fp32 main grads (slime's MoE recipes); a fixed 4 GiB covers context and buffers.
 7. No GPU was available to this implementation: predicted vs measured peak memory is not validated.
 8. Ray layout: bundle CPUs are logical (a 2-core machine runs trainer, engine and 2 rollout workers, 4 bundles);
    the embedded engine publishes from disk (/update_weights_from_disk), the cluster through NCCL.
 9. The behaviour policy is a second model on the device (counted: `behaviour`), not swapped in and out of the
    actor's parameters as slime does with its host snapshots; host memory is reported, not checked against a budget.
"""
import argparse
import datetime
import importlib.util
import itertools
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 1024**3


# ----------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    hidden: int
    n_experts: int
    top_k: int
    moe_ffn: int
    shared_ffn: int
    n_gdn: int
    n_attn: int
    vocab: int
    n_heads: int  # gated attention query heads
    n_kv_heads: int
    head_dim: int
    lin_k_heads: int  # Gated DeltaNet key heads
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int = 4
    chunk: int = 64  # GDN chunk size
    tie_embeddings: bool = False


MODEL_SHAPES = {  # the one table of the Qwen3.5 shapes (mcore.megatron_shape gives Megatron's names)
    "qwen35-122b-a10b": ModelConfig("qwen35-122b-a10b", 48, 3072, 256, 8, 1024, 1024, 36, 12, 248320,
                                    32, 2, 256, 16, 64, 128, 128),
    "qwen35-35b-a3b": ModelConfig("qwen35-35b-a3b", 40, 2048, 256, 8, 512, 512, 30, 10, 248320,
                                  16, 2, 256, 16, 32, 128, 128),
    # model.tiny_config("qwen3_5_moe") at the embedded vocabulary: the CPU rehearsal of the cluster path
    # (cluster/launch.py)
    "t1-tiny": ModelConfig("t1-tiny", 4, 128, 8, 2, 128, 128, 3, 1, 2048, 4, 2, 32, 2, 4, 32, 32),
}


def gdn_params(c: ModelConfig) -> int:
    conv_dim = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim
    vdim = c.lin_v_heads * c.lin_v_dim
    return (c.hidden * conv_dim + c.hidden * vdim + 2 * c.hidden * c.lin_v_heads  # in_proj_qkv, z, b, a
            + conv_dim * c.conv_kernel + 2 * c.lin_v_heads + c.lin_v_dim + vdim * c.hidden)  # conv, dt, A, norm, out


def attn_params(c: ModelConfig) -> int:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return c.hidden * 2 * q + 2 * c.hidden * kv + q * c.hidden + 2 * c.head_dim  # q(+gate), k, v, o, q/k norm


def param_counts(c: ModelConfig, critic: bool = False) -> dict:
    """Parameter counts by kind. critic: lm_head replaced by a scalar value head (h -> 1)."""
    expert = c.n_layers * c.n_experts * 3 * c.hidden * c.moe_ffn  # gate, up, down per expert
    router = c.n_layers * c.n_experts * c.hidden
    shared = c.n_layers * (3 * c.hidden * c.shared_ffn + c.hidden)  # shared expert + its sigmoid gate
    mixers = c.n_gdn * gdn_params(c) + c.n_attn * attn_params(c)
    norms = c.n_layers * 2 * c.hidden + c.hidden
    embed = c.vocab * c.hidden
    head = (c.hidden + 1) if critic else (0 if c.tie_embeddings else c.vocab * c.hidden)
    layers = mixers + shared + norms - c.hidden  # per-layer dense, final norm excluded
    return dict(expert=expert, router=router, layers_dense=layers, final_norm=c.hidden, embed=embed, head=head,
                total=expert + router + layers + c.hidden + embed + head)


# ----------------------------------------------------------------------------- plans and validity
@dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    recompute: bool = True  # Megatron full recompute, uniform, 1 layer per checkpoint

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp  # W = TP*PP*CP*DP

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.ep * self.etp)  # EP*ETP*EDP = TP*CP*DP


def plan_errors(c: ModelConfig, p: Plan, tokens: int) -> list:
    """Megatron-Core's divisibility rules; an empty list means the plan is valid."""
    e = []
    for name, n in [("attention heads", c.n_heads), ("KV heads", c.n_kv_heads),
                    ("GDN key heads", c.lin_k_heads), ("GDN value heads", c.lin_v_heads)]:
        if n % p.tp:
            e.append(f"{name} {n} % TP {p.tp}")
    if c.n_layers % p.pp:
        e.append(f"layers {c.n_layers} % PP {p.pp}")
    if c.n_experts % p.ep:
        e.append(f"experts {c.n_experts} % EP {p.ep}")
    if c.moe_ffn % p.etp:
        e.append(f"expert FFN {c.moe_ffn} % ETP {p.etp}")
    if (p.tp * p.cp * p.dp) % (p.ep * p.etp):
        e.append(f"TP*CP*DP {p.tp * p.cp * p.dp} % EP*ETP {p.ep * p.etp}")
    if p.tp > 1 and tokens % p.tp:
        e.append(f"tokens {tokens} % TP {p.tp} (sequence parallel)")
    if p.cp > 1 and tokens % c.chunk:
        e.append(f"tokens/rank {tokens} % chunk {c.chunk} (CP splits GDN on chunk boundaries)")
    return e


# ----------------------------------------------------------------------------- memory model
def layer_activation_bytes(c: ModelConfig, p: Plan) -> dict:
    """Saved-for-backward bytes per token per layer on one device (bf16 = 2 B, fp32 = 4 B).

    sp = TP when TP > 1 (Megatron enables sequence parallel with MoE + TP): layer-boundary tensors are
    split by TP; head-parallel tensors are split by TP as well.
    """
    h, tp, sp = c.hidden, p.tp, p.tp
    boundary = 4 * 2 * h / sp  # input norm in/out, post-attention norm in/out
    conv_dim = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim
    vdim, nv = c.lin_v_heads * c.lin_v_dim, c.lin_v_heads
    gdn = (3 * 2 * conv_dim  # qkv proj out (conv in), conv out, silu out (kernel q, k, v)
           + 2 * vdim + 2 * 2 * nv + 2 * 4 * nv  # z, a/b proj, g and beta in fp32
           + 4 * c.chunk * nv  # FLA's A (chunk-local UT inverse, fp32); chunk states are recomputed
           + 3 * 2 * vdim) / tp  # kernel out, gated-norm out, out_proj input
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    attn = (2 * 2 * q + 2 * 2 * kv  # q(+gate) proj, k, v
            + 2 * q + 2 * kv  # q/k norm outputs (rope inputs); rope'd q, k, v are flash's inputs
            + 2 * q + 4 * c.n_heads + 2 * q) / tp  # flash out, logsumexp (fp32), gated o_proj input
    k, f, fs = c.top_k, c.moe_ffn, c.shared_ffn
    moe = (2 * 4 * c.n_experts / sp  # router logits + scores, fp32
           + k * (4 * h * p.etp + 6 * f) / sp  # per routed pair: dispatched in, combine in, fc1 (2f), act (f)
           + 6 * fs / tp + 2 * h / sp)  # shared expert fc1 + act, gate
    return dict(gdn=boundary + gdn + moe, attn=boundary + attn + moe, boundary_in=2 * h / sp)


PUBLISHED_VERSIONS = 2  # trainer.Trainer.mark_published keeps the last two published versions (t-1, t)


def device_memory(c: ModelConfig, p: Plan, tokens: int, network: str = "actor", stage: int = 0,
                  overhead_gib: float = 4.0, grad_bytes: int = 4, behaviour_copies: int = 1,
                  published_on_device: bool = False) -> dict:
    """Per-device bytes for one network ("actor" or "critic") on pipeline stage `stage`.

    The actor's device total counts the behaviour copy (behaviour_copies bf16 copies of its shard; train_t1's
    Trainer holds one); the published snapshots are host memory (`host`, not in `total`) unless
    published_on_device (a trainer that kept them on the GPU, as train_t1 did before: the planner must not
    promise that)."""
    n = param_counts(c, critic=(network == "critic"))
    L = c.n_layers // p.pp
    first, last = stage == 0, stage == p.pp - 1
    dense = (n["layers_dense"] * L / c.n_layers + (n["embed"] if first else 0)
             + (n["head"] + n["final_norm"] if last else 0)) / p.tp
    router = n["router"] / p.pp
    expert = n["expert"] / (p.pp * p.ep * p.etp)  # this device's expert shard
    local = dense + router + expert
    params = 2 * local  # bf16 weights
    actor = network == "actor"
    behaviour = 2 * local * behaviour_copies if actor else 0  # the behaviour policy's weights (version t-1)
    published = 2 * local * PUBLISHED_VERSIONS if actor else 0  # snapshots of the published versions
    grads = grad_bytes * local  # fp32 main grads (full buffer; reduce-scattered, not sharded)
    optimizer = 12 * (dense + router) / (p.dp * p.cp)  # dense: distributed optimizer over DP x CP
    expert_optimizer = 12 * expert / p.edp  # experts: over the expert-data-parallel group
    # activations: which layers does this stage own? (GDN:attention = 3:1, every 4th is attention)
    pat = ["attn" if (i + 1) % (c.n_layers // c.n_attn) == 0 else "gdn" for i in range(c.n_layers)]
    mine = pat[stage * L:(stage + 1) * L]
    a = layer_activation_bytes(c, p)
    n_flight = p.pp - stage  # 1F1B: stage s holds PP - s micro-batches in flight
    if p.recompute:
        acts = n_flight * L * a["boundary_in"] * tokens + max(a[t] for t in set(mine)) * tokens
    else:
        acts = n_flight * sum(a[t] for t in mine) * tokens
    if first:
        acts += n_flight * 2 * c.hidden / p.tp * tokens  # embedding output
    if last:  # logits: bf16 out + fp32 softmax over V/TP (actor); scalar values (critic)
        acts += (6 * c.vocab / p.tp if network == "actor" else 2 * c.hidden / p.tp + 8) * tokens
    out = dict(params=params, behaviour=behaviour + (published if published_on_device else 0), grads=grads,
               optimizer=optimizer, expert_optimizer=expert_optimizer, activations=acts, overhead=overhead_gib * GiB)
    out["total"] = sum(out.values())
    out["host"] = 0 if published_on_device else published  # host memory per device, not in b(Pi, T)
    return out


def memory(c: ModelConfig, p: Plan, tokens: int, network: str = "actor", **kw) -> dict:
    """b(Pi, T): the worst of the first and last pipeline stage."""
    stages = {0, p.pp - 1}
    return max((device_memory(c, p, tokens, network, s, **kw) for s in stages), key=lambda d: d["total"])


def feasibility(c: ModelConfig, p: Plan, tokens: int, mem_bytes: float, seq_len: int = 0, **kw):
    """(feasible, reason, {actor: breakdown, critic: breakdown})."""
    nets = {net: memory(c, p, tokens, net, **kw) for net in ("actor", "critic")}
    reasons = []
    for net, d in nets.items():
        if d["total"] > mem_bytes:
            term = max((k for k in d if k not in ("total", "host")), key=d.get)
            reasons.append(f"{net} total {d['total'] / GiB:.1f} GiB > M = {mem_bytes / GiB:.0f} GiB "
                           f"(largest term: {term} {d[term] / GiB:.1f} GiB)")
    if seq_len and p.cp * tokens < seq_len:
        reasons.append(f"context: CP*T = {p.cp * tokens} < seq_len {seq_len}")
    return not reasons, "; ".join(reasons), nets


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(c: ModelConfig, gpus: int, tokens: int) -> list:
    """Every valid plan (Megatron-Core rules) for W = gpus, with and without full recompute."""
    plans = []
    for tp, pp, cp in itertools.product(divisors(gpus), repeat=3):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        for ep, etp in itertools.product(divisors(c.n_experts), divisors(c.moe_ffn)):
            if etp > 8 or (tp * cp * dp) % (ep * etp):
                continue  # ETP beyond a node is never useful; keep the listing finite
            for rc in (False, True):
                p = Plan(tp, pp, cp, ep, etp, dp, rc)
                if not plan_errors(c, p, tokens):
                    plans.append(p)
    return plans


def plan_table(c: ModelConfig, gpus: int, tokens: int, mem_gib: float, seq_len: int = 0, **kw) -> list:
    rows = []
    for p in enumerate_plans(c, gpus, tokens):
        ok, reason, nets = feasibility(c, p, tokens, mem_gib * GiB, seq_len, **kw)
        rows.append(dict(asdict(p), feasible=ok, reason=reason,
                         actor={k: int(v) for k, v in nets["actor"].items()},
                         critic={k: int(v) for k, v in nets["critic"].items()}))
    # preference among feasible plans: no recompute, fewest pipeline stages, smallest TP/CP, largest EP
    # ETP = 1 first (no expert-TP traffic), then the largest EP (smallest expert shard)
    rows.sort(key=lambda r: (not r["feasible"], r["recompute"], r["pp"], r["tp"], r["cp"], r["etp"], -r["ep"],
                             r["actor"]["total"]))
    return rows


def format_table(rows: list, top: int = 0, tokens: int = 0, compact: bool = True) -> str:
    """Text table. compact keeps, for each (TP, PP, recompute), the first row in preference order: the
    smallest CP that fits (with T per device, CP changes the longest sequence CP*T, not the bytes),
    then ETP = 1 and the largest EP."""
    if compact:
        seen, kept = set(), []
        for r in rows:
            key = (r["tp"], r["pp"], r["recompute"], r["feasible"])
            if key not in seen:
                seen.add(key)
                kept.append(r)
        rows = kept
    hdr = (f"{'TP':>3}{'PP':>4}{'CP':>4}{'EP':>5}{'ETP':>4}{'DP':>4}{'EDP':>5} rc{'CP*T':>6} |"
           f"{'params':>7}{'behav':>6}{'grads':>7}{'opt':>6}{'expopt':>7}{'act':>7}{'actor':>7} |{'critic':>7} |"
           f"{'host':>6}  GiB")
    lines = [hdr, "-" * len(hdr)]
    for r in rows[:top or None]:
        a, cr = r["actor"], r["critic"]
        edp = r["tp"] * r["cp"] * r["dp"] // (r["ep"] * r["etp"])
        g = lambda x: x / GiB  # noqa: E731
        line = (f"{r['tp']:>3}{r['pp']:>4}{r['cp']:>4}{r['ep']:>5}{r['etp']:>4}{r['dp']:>4}{edp:>5}"
                f" {'y' if r['recompute'] else 'n':>2}{r['cp'] * tokens // 1024:>5}K |{g(a['params']):7.1f}"
                f"{g(a['behaviour']):6.1f}{g(a['grads']):7.1f}"
                f"{g(a['optimizer']):6.1f}{g(a['expert_optimizer']):7.2f}{g(a['activations']):7.1f}"
                f"{g(a['total']):7.1f} |{g(cr['total']):7.1f} |{g(a['host']):6.1f}")
        lines.append(line + ("" if r["feasible"] else "  x " + r["reason"]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """`python infra.py plan ...` (this module imports the standard library only; torch where a function needs it)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "), formatter_class=fmt)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="enumerate valid plans, mark feasible ones", formatter_class=fmt)
    pl.add_argument("--preset", default="qwen35-122b-a10b", choices=sorted(MODEL_SHAPES), help="the model's shape")
    pl.add_argument("--gpus", type=int, required=True, default=argparse.SUPPRESS,
                    help="W: devices of the trainer (required)")
    pl.add_argument("--tokens", type=int, default=16384, help="T: tokens per device per micro-batch")
    pl.add_argument("--seq-len", type=int, default=0, help="longest trajectory; requires CP*T >= seq_len")
    pl.add_argument("--mem-gib", type=float, default=95.0, help="M: per-device budget for each network")
    pl.add_argument("--top", type=int, default=25, help="rows to print (0 = all)")
    pl.add_argument("--all", action="store_true", help="print infeasible plans too, with the reason")
    pl.add_argument("--json", action="store_true", help="one JSON line with every valid plan")
    pl.add_argument("--full", action="store_true", help="every EP x ETP, not only the preferred one per row")
    return ap



# ----------------------------------------------------------------------------- process groups, ports
def init_update_group(master_address, master_port, rank, world_size, group_name, backend="nccl", timeout_s=1800,
                      store=None):
    """A process group outside the default one (trainer rank 0 + every engine rank), as SGLang builds it
    (cluster/launch.py departure 4: SGLang's init_custom_process_group when sglang is importable). store: the store
    at master_address:master_port (host_store's, or a client of it) in place of the tcp:// rendezvous, whose keys
    are the same (the group's name before each)."""
    try:
        from sglang.srt.utils import init_custom_process_group as sgl_init  # identical keys (departure 4)
    except ImportError:
        sgl_init = None
    import datetime
    timeout = datetime.timedelta(seconds=timeout_s)
    init = f"tcp://{master_address}:{master_port}"
    if sgl_init is not None and store is None:
        return sgl_init(backend=backend, init_method=init, world_size=world_size, rank=rank,
                        group_name=group_name, timeout=timeout)
    import inspect
    from torch.distributed import distributed_c10d as c10d
    if store is None:
        store, rank, world_size = next(c10d.rendezvous(init, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)  # keys of this group apart from any other
    opt = "backend_options" if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters \
        else "pg_options"
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout, **{opt: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def host_store(timeout_s=1800):
    """The rendezvous store of a group (torch's TCPStore), served by this process, the group's rank 0, on every
    interface and a port the OS picks, held from the pick on: a port from free_port is free when picked, and another
    process can bind it before rank 0 does (a suite's gloo group failed on EADDRINUSE). Ranks join it as clients
    (TCPStore(host, port, is_master=False) -> init_process_group(store=...); init_update_group's tcp:// rendezvous
    for ranks > 0, store= for this process: the same keys). init_process_group puts no prefix before a given store's
    keys and one before a rendezvous', so every rank of a default group joins with a client store."""
    import datetime
    from torch.distributed import TCPStore
    # the server listens on every interface; 127.0.0.1 is where this process reaches it as a client
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def free_port(host="127.0.0.1") -> int:
    """A free TCP port on host ("" binds every interface: the cluster's servers). Free when picked only: a group's
    rendezvous port is held by host_store instead."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- does a trainer layout run here
def check_plan(p: dict, backend: str, trainer_ranks: int, plan: str) -> None:
    """A trainer layout p (trainer.parallel_plan: tp, pp, cp, ep, etp, dp, world) that the chosen backend runs:
    the hf backend runs full replicas only; Megatron's expert layout needs ep * etp to divide tp * cp * dp; context
    parallel is not written for pipeline stages. Refused by flag name."""
    if plan and trainer_ranks not in (1, p["world"]):
        raise ValueError(f"--trainer-ranks: {trainer_ranks}, but --plan lays out {p['world']} ranks "
                         "(tp * pp * cp * dp)")
    if backend == "hf" and max(p["tp"], p["pp"], p["cp"], p["ep"]) > 1:
        raise ValueError(f"--plan: {plan} asks for model parallel; the hf backend only runs full replicas "
                         "(dp); use --backend megatron")
    if backend == "megatron" and p["world"] > 1:
        if p["cp"] > 1 and p["pp"] > 1:  # mcore's CP chunks are not passed between pipeline stages
            raise NotImplementedError(f"--plan: cp = {p['cp']} with pp = {p['pp']}: context parallel with pipeline "
                                      "parallel is not written (cluster/mcore_parallel.py departure 2); "
                                      "use cp with tp / ep / dp")
        if p["ep"] > 1 and (p["tp"] * p["cp"] * p["dp"]) % (p["ep"] * p["etp"]):  # Megatron's expert layout
            raise ValueError(f"--plan: ep * etp = {p['ep'] * p['etp']} must divide tp * cp * dp = "
                             f"{p['tp'] * p['cp'] * p['dp']}")


# host bytes per parameter of a CPU trainer rank's state, before sharding: actor + behaviour copy + critic in the
# parameter dtype, Adam's two fp32 moments of actor and critic, and with bf16 the fp32 masters of actor and critic
TRAINER_BYTES_PER_PARAM = {"fp32": 3 * 4 + 4 * 4, "bf16": 3 * 2 + 4 * 4 + 2 * 4}


def check_megatron_model_path(path: str, dtype: str = "fp32") -> None:
    """--model-path with --backend megatron: the trainer builds its Megatron models from that HF checkpoint
    (mcore.trainer_models, each rank reading its shards): on a CUDA node the cluster model (bf16 with --param-dtype
    bf16, Megatron's distributed optimizer, TE layers and DeepEP where they import; the planner above sizes the
    device memory), on the CPU local modules, which is what the CPU rehearsal of the cluster path runs. Refused by
    name: a layout the converter does not know; on the CPU a checkpoint whose trainer state
    (TRAINER_BYTES_PER_PARAM) exceeds this machine's memory. A GPU node without flash-linear-attention runs
    Megatron's torch gated delta rule (cluster.mcore_cpu.init_cpu), slower: said in the log, not refused."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    kind = cfg.get("model_type", "")
    if kind not in ("qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe"):
        raise ValueError(f"--model-path: {path} holds a {kind!r} model; the Megatron backend converts the Qwen3-MoE "
                         "and Qwen3.5-MoE layouts")
    import torch
    if torch.cuda.is_available():
        if kind != "qwen3_moe" and importlib.util.find_spec("fla") is None:
            print(f"[train_t1] --model-path {path}: no flash-linear-attention (`fla`) on this GPU node: Megatron's "
                  "GatedDeltaNet runs its torch reference kernel (slower, same numbers)", file=sys.stderr)
        return
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(cfg.get("torch_dtype", cfg.get("dtype"))), 2)
    need = weights / dtype_bytes * TRAINER_BYTES_PER_PARAM[dtype]
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ValueError(f"--model-path: {path} has {weights / 2**30:.1f} GiB of weights; a CPU trainer holds "
                         f"{TRAINER_BYTES_PER_PARAM[dtype]} bytes a parameter ({need / 2**30:.0f} GiB before "
                         f"sharding) and this machine has {have / 2**30:.0f} GiB; train it on GPU nodes")


# ----------------------------------------------------------------------------- Ray layout
# One-step async at the embedded scale runs as Ray actors on this machine (cluster/actors.py starts them): the trainer
# (actor + critic co-resident, trainer.Trainer), the engine(s) (engine.server.EngineActor: SGLang's HTTP protocol) and
# the rollout workers (rollout.RolloutWorker: trials in sandboxes); the publish barrier is Trainer.publish
# (engine.client.DiskPublisher here). One placement group holds them all: one bundle per trainer rank, then one per
# engine, then one per rollout worker; PACK on one machine, SPREAD across nodes (the cluster's
# SGLang servers get their own GPU placement groups in cluster/launch.py). Bundle CPUs are logical: on a 2-core
# machine the actors share the cores (infra departure 8).

def core_split() -> tuple[list, list]:
    """--pin-cores: this machine's cores in two disjoint halves -> (trainer's, rollout side's: engines + workers),
    the CPU analogue of the paper's disjoint trainer / inference devices."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"--pin-cores: needs at least 2 cores, this process may run on {cores}")
    return cores[:len(cores) // 2], cores[len(cores) // 2:]


def pin(cores) -> None:
    """Pin every thread of this process (and what it starts later) to `cores` (Linux sched_setaffinity is per
    thread: the threads Ray and torch already started are pinned one by one)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def ray_start(n_bundles: int, address: str = "", threads: int = 2):
    """Join the Ray cluster at `address` ($RAY_ADDRESS) or start one on this machine for this process only.

    A started cluster shares this process's fate: killed with -9, its raylet dies and takes the actors
    (trainer, engine, rollout workers and their sandboxes) with it. Workers import the repo's modules."""
    import ray
    if ray.is_initialized():
        return ray
    root = os.path.dirname(os.path.abspath(__file__))
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
                        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}}
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        # the workers get their variables from the raylet's environment (it starts them; ours is put back once it
        # runs), not from a runtime_env: that starts each actor through one more interpreter (setup_worker.py); no
        # idle workers for the first driver: they only imported Ray (results/LOG.md, 2026-12-07)
        saved = {k: os.environ.get(k) for k in env["env_vars"]}
        os.environ.update(env["env_vars"])
        try:
            ray.init(num_cpus=max(os.cpu_count() or 1, n_bundles), include_dashboard=False, log_to_driver=True,
                     object_store_memory=256 * 1024**2, _system_config={"prestart_worker_first_driver": False},
                     configure_logging=False)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return ray


def ray_placement(groups: list, timeout_s: float = 600):
    """The one Ray layout of both scales: groups = [(strategy, {role: [bundle, ...]}), ...], one placement group
    each (PACK: as few nodes as possible; SPREAD: across nodes; a bundle never spans nodes) -> (placement groups,
    {role: [actor options, one per bundle]}); an actor's options put it in its bundle with the bundle's GPUs."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    pgs, place = [], {}
    for strategy, roles in groups:
        bundles = [b for role in roles.values() for b in role]
        pg = placement_group(bundles, strategy=strategy)
        ray.get(pg.ready(), timeout=timeout_s)
        pgs.append(pg)
        i = 0
        for role, rb in roles.items():
            place[role] = [{"num_cpus": 1, "num_gpus": b.get("GPU", 0), "scheduling_strategy":
                            PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i + j)}
                           for j, b in enumerate(rb)]
            i += len(rb)
    return pgs, place


def ray_layout(n_engines: int, n_workers: int, trainer_gpus: float = 0, engine_gpus: float = 0,
               strategy: str = "PACK", n_trainers: int = 1):
    """The embedded layout: one placement group, a bundle per trainer rank, then per engine, then per rollout
    worker -> (placement groups, {"trainers": [...], "engines": [...], "workers": [...]}) (ray_placement)."""
    gpu = lambda g: {"GPU": g} if g else {}  # noqa: E731
    return ray_placement([(strategy, {"trainers": [{"CPU": 1, **gpu(trainer_gpus)}] * n_trainers,
                                      "engines": [{"CPU": 1, **gpu(engine_gpus)}] * n_engines,
                                      "workers": [{"CPU": 1}] * n_workers})], timeout_s=300)


def ray_stop(pgs: list) -> None:
    """Remove the run's placement groups (their actors die with them) and disconnect; a started cluster stops."""
    import ray
    if not ray.is_initialized():
        return
    try:
        from ray.util.placement_group import remove_placement_group
        for pg in pgs:
            remove_placement_group(pg)
    finally:
        ray.shutdown()


def main(args) -> None:
    """`plan`: the valid plans of a model on W devices, the feasible ones first."""
    c = MODEL_SHAPES[args.preset]
    rows = plan_table(c, args.gpus, args.tokens, args.mem_gib, args.seq_len)
    if args.json:
        return print(json.dumps(rows))
    n = param_counts(c)
    feas = [r for r in rows if r["feasible"]]
    print(f"{c.name}: {n['total'] / 1e9:.2f}B params ({n['expert'] / 1e9:.2f}B expert); W = {args.gpus}, "
          f"T = {args.tokens} tokens/device, M = {args.mem_gib:g} GiB; expert optimizer 12*P_exp/W = "
          f"{12 * n['expert'] / args.gpus / GiB:.2f} GiB for every plan (Prop. 7.1)")
    print(f"{len(rows)} valid plans, {len(feas)} feasible (actor and critic each <= M); rc = full recompute; behav = "
          f"the behaviour policy's copy (in actor); host = the {PUBLISHED_VERSIONS} published versions kept in host "
          "memory, per device (not in actor)")
    print(format_table(rows if args.all else feas, args.top, args.tokens, compact=not args.full))


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
