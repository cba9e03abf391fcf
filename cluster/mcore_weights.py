"""HF weights into and out of a built Megatron-Core model (paper: infrastructure: the trainer is Megatron-Core, the
engines load Hugging Face checkpoints), sharded per rank; the state-dict conversion itself is cluster/mcore_convert.py.

- `load_hf_into_megatron` (an HF state dict, this rank's shard), `load_hf_into_cluster_model` (the TE-spec cluster
  model), `load_checkpoint_into_megatron` (streams one rank's stage, experts and TP blocks from an HF checkpoint's
  safetensors, never the whole model in memory).
- `gather_full_state`, `to_hf` / `save_hf`: a sharded `MegatronActor` back into an HF model or checkpoint (every rank
  calls them, rank 0 writes).

    python -m pytest tests/test_mcore_tp.py -q     # CPU: tiny Qwen3.5 at TP = 2 (+ SP), EP = 2, gloo; back to HF
    python -m pytest tests/test_mcore_load.py -s   # CPU: per-rank streaming load from safetensors vs the whole dict

Departure from the paper: save and publish gather tensor by tensor to global rank 0 (gather_full_state(to_rank0=True)),
which then holds one copy of the model in the parameter dtype. A model built with the TE spec (mcore._te_spec) is
loaded under to_te_layout's names and gathered back through from_te_layout (is_te).
"""

import contextlib
import os

import torch

from cluster import mcore_parallel
from cluster.mcore_convert import (from_te_layout, hf_layer_to_megatron, hf_to_megatron, is_te, is_tp_cut,
                                   megatron_to_hf, shard_for_ep, shard_for_pp, shard_for_tp, to_te_layout, tp_cuts,
                                   unshard_ep, unshard_pp, unshard_tp)


# --- into a built model: this rank's shard, whole or streamed from the checkpoint's files -------------------------
def load_hf_into_cluster_model(gpt, hf_state_dict, hf):
    """HF weights into the cluster GPTModel (mcore._qwen35_gpt: TE modules, grouped-GEMM experts): hf_to_megatron, this
    rank's shard (shard_for_ep, shard_for_tp), the TE names (to_te_layout), then a strict load (only `_extra_state`
    may be missing). Needs CUDA + Transformer Engine (the model does); on CPU its renames are tested as functions."""
    from megatron.core import parallel_state as ps
    c = gpt.config
    assert c.moe_grouped_gemm, "to_te_layout writes TEGroupedMLP names (moe_grouped_gemm=True)"
    assert c.pipeline_model_parallel_size == 1, "PP > 1: a stage's layers are renumbered from 0, not written here"
    sd = hf_to_megatron(hf_state_dict, hf)
    sd = shard_for_ep(sd, hf.num_experts, ps.get_expert_model_parallel_rank(), c.expert_model_parallel_size)
    sd = shard_for_tp(sd, hf, ps.get_tensor_model_parallel_rank(), c.tensor_model_parallel_size,
                      ps.get_expert_tensor_parallel_rank(), c.expert_tensor_parallel_size)
    sd = to_te_layout(sd, hf)
    missing, unexpected = gpt.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"load_hf_into_cluster_model: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    return gpt


def load_hf_into_megatron(gpt, hf_state_dict, hf):
    """Copy converted HF weights into `gpt`; every real parameter must be covered (only _extra_state left)."""
    c = gpt.config
    sd = hf_to_megatron(hf_state_dict, hf)
    if max(c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size) > 1:
        from megatron.core import parallel_state as ps  # this rank's shard: experts cut by expert TP, the rest by TP
        sd = shard_for_ep(sd, hf.num_experts, ps.get_expert_model_parallel_rank(), c.expert_model_parallel_size)
        sd = shard_for_tp(sd, hf, ps.get_tensor_model_parallel_rank(), c.tensor_model_parallel_size,
                          ps.get_expert_tensor_parallel_rank(), c.expert_tensor_parallel_size)
    sd = to_te_layout(sd, hf) if is_te(gpt) else sd  # the cluster model's names (CUDA + TE), by global layer
    if c.pipeline_model_parallel_size > 1:  # this stage's layers
        sd = shard_for_pp(sd, *mcore_parallel.stage_layers(c), gpt.pre_process, gpt.post_process)
    missing, unexpected = gpt.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"hf_to_megatron: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    return gpt


class _CheckpointReader:
    """An HF checkpoint directory's safetensors (`model.safetensors`, or the shards `model.safetensors.index.json`
    lists) as the state dict hf_layer_to_megatron reads: sd[key] under the in-memory names (experts fused
    (E, 2I, H) / (E, H, I), read from fused tensors or from each expert's gate / up / down_proj as save_pretrained
    writes them; the `model.language_model.` prefix of Qwen3.5's multimodal checkpoints accepted), as float32 (what
    model.load_actor gives), fetched on access with safe_open + get_slice and only this rank's part: the routed
    experts `experts` (this EP rank's contiguous range) and, for the tensors shard_for_tp cuts whole (CUT_ON_READ,
    the 1:1 copies of hf_to_megatron; experts' down_proj by expert TP), this TP rank's block. read_bytes counts
    what was fetched (numel * element size of every tensor or slice, in the file's dtype)."""
    CUT_ON_READ = {"model.embed_tokens.weight": 0, "lm_head.weight": 0, "self_attn.o_proj.weight": 1,
                   "linear_attn.out_proj.weight": 1, "linear_attn.A_log": 0, "linear_attn.dt_bias": 0,
                   "mlp.shared_expert.down_proj.weight": 1}  # HF key suffix: dim of its TP cut

    def __init__(self, path, files, experts, tp_rank, tp_size, etp_rank, etp_size):
        import json
        from safetensors import safe_open
        path = str(path)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]  # key -> file name
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
                where = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"path: no model.safetensors or model.safetensors.index.json in {path!r}")
        self.where, self.experts, self.read_bytes = where, experts, 0
        self.tp, self.etp = (tp_rank, tp_size), (etp_rank, etp_size)
        names = sorted(set(where.values()))  # files: an ExitStack that closes them
        self.files = {n: files.enter_context(safe_open(os.path.join(path, n), framework="pt")) for n in names}
        self.file_bytes = sum(os.path.getsize(os.path.join(path, n)) for n in names)

    def _name(self, key):
        if key not in self.where and key.startswith("model."):
            return "model.language_model." + key[len("model."):]
        return key

    def __contains__(self, key):
        return self._name(key) in self.where

    def _read(self, key, cuts=(), experts=False):
        """cuts: ((dim, (rank, size)), ..): that rank's torch.chunk block along each dim; experts: rows self.experts."""
        name = self._name(key)
        if name not in self.where:
            raise KeyError(f"checkpoint: no tensor {key!r}")
        w = self.files[self.where[name]].get_slice(name)
        shape = w.get_shape()
        index = [slice(None)] * len(shape)
        if experts:
            index[0] = slice(self.experts.start, self.experts.stop)
        for dim, (rank, size) in cuts:
            per = -(-shape[dim] // size)  # torch.chunk's block size
            index[dim] = slice(min(rank * per, shape[dim]), min((rank + 1) * per, shape[dim]))
        w = w[tuple(index)]
        self.read_bytes += w.numel() * w.element_size()
        return w.to(torch.float32)

    def __getitem__(self, key):
        if key.endswith("mlp.experts.gate_up_proj"):  # (E_local, 2I, H); fc1 is cut per part ([gate; up]): whole
            if key in self:
                return self._read(key, experts=True)
            h = key[:-len("gate_up_proj")]
            return torch.stack([torch.cat([self._read(f"{h}{e}.gate_proj.weight"),
                                           self._read(f"{h}{e}.up_proj.weight")])
                                for e in self.experts])
        if key.endswith("mlp.experts.down_proj"):  # (E_local, H, I / etp): row-parallel, this expert-TP rank's columns
            if key in self:
                return self._read(key, ((2, self.etp),), experts=True)
            h = key[:-len("down_proj")]
            return torch.stack([self._read(f"{h}{e}.down_proj.weight", ((1, self.etp),)) for e in self.experts])
        dim = next((d for s, d in self.CUT_ON_READ.items() if key.endswith(s)), None)
        return self._read(key, () if dim is None else ((dim, self.tp),))


def load_checkpoint_into_megatron(gpt, path, hf, stats=None):
    """load_hf_into_megatron from the HF checkpoint directory `path` without the whole model in memory: layer by
    layer, this rank reads only its part of the safetensors (_CheckpointReader): its pipeline stage's layers (the
    embedding on the first stage, the final norm and output layer on the last), its EP rank's experts, and its TP /
    expert-TP block of the tensors shard_for_tp cuts whole (vocab rows of embedding and output layer, A_log /
    dt_bias, the row-parallel columns of o_proj / out_proj / down_proj); tensors cut per part (linear_qkv's query
    groups, GDN in_proj / conv1d, fc1 [gate; up]) are read whole for one layer and cut by shard_for_tp. The
    conversion is hf_to_megatron's per layer (hf_layer_to_megatron), then shard_for_ep / shard_for_tp /
    shard_for_pp, each layer loaded into `gpt` as it is read; the result is bit-identical to load_hf_into_megatron
    of model.load_actor(path)'s state dict (tests/test_mcore_load.py), with the same strict check. stats (a dict,
    optional) gets read_bytes (fetched from the files) and file_bytes (the files' size)."""
    c = gpt.config
    tp, ep, etp = c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size
    tp_rank = ep_rank = etp_rank = 0
    if max(tp, ep, etp) > 1:
        from megatron.core import parallel_state as ps
        tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        etp_rank = ps.get_expert_tensor_parallel_rank()
    per = hf.num_experts // ep
    experts = range(ep_rank * per, (ep_rank + 1) * per)  # shard_for_ep's contiguous block
    first, last = mcore_parallel.stage_layers(c)
    _, cols, rows = tp_cuts(hf)
    cut_on_read = tuple(k for k in cols + rows if k != "linear_qkv.weight")  # Megatron names of CUT_ON_READ's
    expected = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    loaded, unexpected = set(), []
    te = is_te(gpt)

    # part of hf_to_megatron's dict (global layer numbers, this rank's experts) -> this rank's, into gpt
    def load(part):
        part = shard_for_ep(part, hf.num_experts, ep_rank, ep)
        done = {k: w for k, w in part.items() if k.endswith(cut_on_read)}  # cut at read
        part = {**shard_for_tp({k: w for k, w in part.items() if k not in done}, hf, tp_rank, tp, etp_rank, etp),
                **done}
        part = to_te_layout(part, hf, whole=False) if te else part  # TE names (CUDA) by global layer number,
        part = shard_for_pp(part, first, last, gpt.pre_process, gpt.post_process)  # then the stage's local ones
        unexpected.extend(gpt.load_state_dict(part, strict=False).unexpected_keys)
        loaded.update(part)

    with contextlib.ExitStack() as files:
        sd = _CheckpointReader(path, files, experts, tp_rank, tp, etp_rank, etp)
        ends = {}
        if gpt.pre_process:
            ends["embedding.word_embeddings.weight"] = sd["model.embed_tokens.weight"]
        if gpt.post_process:
            ends["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
            ends["output_layer.weight"] = sd["lm_head.weight" if "lm_head.weight" in sd
                                             else "model.embed_tokens.weight"]
        load(ends)
        for i in range(first, last):
            load(hf_layer_to_megatron(sd, hf, i, experts))
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(f"load_checkpoint_into_megatron: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if stats is not None:
        stats.update(read_bytes=sd.read_bytes, file_bytes=sd.file_bytes)
    return gpt


# --- the way back: a sharded GPTModel -> the TP = EP = PP = 1 state dict -> a Hugging Face checkpoint ---------
def gather_full_state(gpt, hf, to_rank0: bool = False) -> dict | None:
    """This rank's GPTModel -> the TP = EP = 1 state dict (no _extra_state), what megatron_to_hf /
    critic_megatron_to_hf take. Sharded (TP or EP > 1, parallel_state initialised) it is a collective: every rank
    of the model-parallel job calls it. Dense tensors cut by shard_for_tp's rules are gathered over the TP group,
    tensor by tensor; expert tensors over the expert-TP group (its own size, ETP, which may differ from TP), then
    over the expert-parallel group; then unshard_tp / unshard_ep. Replicated tensors are this rank's, not sent
    (equal over ranks once grads are all-reduced). A MegatronCritic's value head (mcore._ValueHead, weight (1, H)
    and bias) is replicated, not vocab-parallel: taken as it is. Pipeline stages: each stage's TP / EP-gathered part
    is gathered over the PP group and renumbered (unshard_pp).
    to_rank0=False: all-gathers, every rank gets the whole dict (the tests compare ranks). to_rank0=True (save and
    publish: at 122B no rank but the writer may hold the model): each level gathers to its group's first
    rank, only the data-parallel replica of global rank 0 takes part (the others return at once), and every rank
    but global rank 0 returns None; no receive buffer is allocated off the receiving ranks.
    At TP = EP = ETP = PP = 1 it is the local state dict, no communication."""
    c = gpt.config
    tp, ep, etp = c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size
    sd = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    if is_te(gpt):  # the cluster model's TE names -> the local modules' (this stage's layers numbered from 0)
        sd = from_te_layout(sd, hf, mcore_parallel.stage_layers(c)[0])
    dist = torch.distributed
    if tp == 1 and ep == 1 and etp == 1 and c.pipeline_model_parallel_size == 1:
        return sd if not to_rank0 or not dist.is_initialized() or dist.get_rank() == 0 else None
    from megatron.core import parallel_state as ps
    value_head = isinstance(getattr(gpt, "output_layer", None), mcore_parallel._ValueHead)
    head = {k: sd.pop(k) for k in list(sd) if value_head and k.startswith("output_layer.")}
    experts = {k: sd.pop(k) for k in list(sd) if ".local_experts." in k}

    def gather(part, group, size, which):  # {k: this rank's tensor} -> [{k: rank r's tensor}] in group order
        first = dist.get_rank(group) == 0  # to_rank0: the receiver; the others send and get None
        ranks = [{} for _ in range(size)]
        for k, w in part.items():  # the same keys in the same order on every rank of the group
            ws = [w] * size
            if which(k) and not to_rank0:
                ws = [torch.empty_like(w) for _ in range(size)]
                dist.all_gather(ws, w.contiguous(), group=group)
            elif which(k):
                ws = [torch.empty_like(w) for _ in range(size)] if first else None
                dist.gather(w.contiguous(), ws, group=group, group_dst=0)
            if first or not to_rank0:
                for r in range(size):
                    ranks[r][k] = ws[r]
        return ranks if first or not to_rank0 else None

    def cut(k):
        return is_tp_cut(k, hf)
    dense_in = expert_in = True  # to_rank0: this rank holds a part of global rank 0's gather at this level
    if to_rank0:  # only global rank 0's data-parallel replica (dense: DP x CP rank 0; experts: expert-DP rank 0)
        dense_in = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        expert_in = ps.get_expert_data_parallel_rank() == 0
    if tp > 1 and dense_in:  # dense tensors (the shared expert too) over the TP group
        got = gather(sd, ps.get_tensor_model_parallel_group(), tp, cut)
        sd, dense_in = (unshard_tp(got, hf, tp), True) if got is not None else (None, False)
    if etp > 1 and expert_in:  # expert tensors over the expert-TP group
        got = gather(experts, ps.get_expert_tensor_parallel_group(), etp, cut)
        experts, expert_in = (unshard_tp(got, hf, etp, etp), True) if got is not None else (None, False)
    if ep > 1 and expert_in:
        got = gather(experts, ps.get_expert_model_parallel_group(), ep, lambda k: True)
        experts, expert_in = (unshard_ep(got, hf.num_experts, ep), True) if got is not None else (None, False)
    if to_rank0 and not (dense_in and expert_in):
        return None
    out = {**sd, **experts, **head}
    if c.pipeline_model_parallel_size > 1:  # every stage's layers (the stage's first global layer numbers them)
        stages = [None] * c.pipeline_model_parallel_size
        mine, group = (mcore_parallel.stage_layers(c)[0], out), ps.get_pipeline_model_parallel_group()
        if to_rank0:  # the holders of each stage's whole part are its ranks with all model-parallel ranks 0
            first = dist.get_rank(group) == 0
            dist.gather_object(mine, stages if first else None, group=group, group_dst=0)
            if not first:
                return None
        else:
            dist.all_gather_object(stages, mine, group=group)
        out = unshard_pp(stages)
    if to_rank0 and dist.get_rank() != 0:
        raise RuntimeError(f"gather_full_state(to_rank0): rank {dist.get_rank()} ended up holding the model: the "
                           "parallel_state layout is not the one this gather assumes (rank 0 first in every group)")
    return out


def to_hf(actor, hf_config, to_rank0: bool = False):
    """The MegatronActor's weights in a Hugging Face model of `hf_config`. Sharded over TP / EP ranks: a collective
    (gather_full_state), every rank calls it and gets the whole model; with to_rank0 global rank 0 alone does (the
    others get None)."""
    from transformers import AutoModelForCausalLM
    sd = gather_full_state(actor.gpt, hf_config, to_rank0)
    if sd is None:
        return None
    dtype = actor.gpt.config.params_dtype  # bf16 training writes bf16 (rank 0 holds one copy, not an fp32 one)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    hf.load_state_dict(megatron_to_hf(sd, hf_config), strict=True)
    return hf


def save_hf(actor, hf_config, tokenizer, path):
    """The MegatronActor's weights as a Hugging Face checkpoint (what the engines load). Under torch.distributed with
    world size > 1 every rank calls it (the gather to rank 0 is a collective); global rank 0 alone holds the model and
    writes, and no rank returns before the checkpoint is on disk."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    hf = to_hf(actor, hf_config, to_rank0=True)  # None on every rank but 0
    if hf is not None:
        os.makedirs(path, exist_ok=True)
        hf.save_pretrained(path)
        tokenizer.save_pretrained(path)
    if world > 1:
        dist.barrier()
