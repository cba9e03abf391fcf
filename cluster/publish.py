"""The weight publish from the trainer to the rollout engines under the publish barrier (paper: infrastructure;
after each PPO step the trainer publishes the new actor weights: pause generation, push them to every engine over
NCCL, resume). `WeightPublisher` is trainer rank 0's side, `SGLangClient` the engine endpoints it calls; the SGLang
HTTP bodies followed are listed above `WeightPublisher`. The embedded engine (engine/server.py) serves the same
endpoints over a gloo group, so the CPU rehearsal and the tests take the same path.

    python -m pytest tests/test_publish.py -q   # CPU: the bodies against SGLang's schemas, the publish end to end

Departures from the paper:
 1. Pause mode "retract": in-flight requests resume after the push with their KV cache recomputed ("abort" would cut
    the agent's turn, "in_place" cannot flush the cache); each token's logprob is still from the weights that
    sampled it, which is what PPO's ratio needs.
 2. Experts are published one by one in Hugging Face names (SGLang maps them onto its fused tensors), gathered over
    EP (and ETP) first; the names come from cluster/mcore_convert.py's converter.
 3. The trainer joins the weight group with SGLang's `init_custom_process_group` when sglang is importable, else an
    equivalent from torch.distributed internals (the CPU tests, gloo): infra.init_update_group.
 4. Not yet run against a real SGLang server: the request bodies are checked against SGLang's schemas and the publish
    protocol end to end over gloo on CPU (tests/test_publish.py).
"""
import concurrent.futures as cf

from engine.client import EngineClient
import infra


class SGLangClient(EngineClient):
    """engine/client.py's EngineClient plus the endpoints only SGLang serves (distributed weight update, memory)."""

    def pause(self, mode="retract"):
        """Publish barrier, first half (departure 1: retract, not abort)."""
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
    interface, with engine/client.py's DiskPublisher (the embedded engines load the checkpoint from disk)."""
    wants_weights = True  # publish broadcasts the tensors it is given

    def __init__(self, clients, engine_world_sizes, master_address, master_port=None,
                 group_name="t1_weight_update", backend="nccl", bucket_bytes=infra.GiB):
        if len(clients) != len(engine_world_sizes):
            raise ValueError("engine_world_sizes: one entry per client")
        self.clients, self.sizes = list(clients), [int(s) for s in engine_world_sizes]
        # no port given: this process serves the group's rendezvous on one the OS picks, held (infra.host_store)
        self.store = None if master_port else infra.host_store()
        self.master_address, self.master_port = master_address, master_port or self.store.port
        self.group_name, self.backend, self.bucket_bytes = group_name, backend, bucket_bytes
        self.group = None
        self.pool = cf.ThreadPoolExecutor(max_workers=max(len(self.clients), 1))

    def connect(self):
        """POST /init_weights_update_group to every engine while this process joins as rank 0."""
        world = 1 + sum(self.sizes)
        offsets = [1 + sum(self.sizes[:i]) for i in range(len(self.sizes))]  # engine i: ranks [off, off+size)
        futs = [self.pool.submit(c.init_weights_update_group, self.master_address, self.master_port, off, world,
                                 self.group_name, self.backend) for c, off in zip(self.clients, offsets)]
        self.group = infra.init_update_group(self.master_address, self.master_port, 0, world, self.group_name,
                                             self.backend, store=self.store)
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
