"""The embedded engine's weights: how new weights reach its model and whether they are there. Machinery, no paper
section (the trainer -> rollout publish of the paper's RL loop lands here).

Three ways in and one out, SGLang's endpoints: a checkpoint directory loaded in place (/update_weights_from_disk);
a publish received over a process group from the trainer (/init_weights_update_group, then buckets over
/update_weights_from_distributed, /destroy_weights_update_group; cluster.publish.WeightPublisher sends them); and the
parameters' storage given up and taken back for a colocated trainer (/release_memory_occupation,
/resume_memory_occupation). engine/server.py runs every change on the scheduler thread while no request runs
(Batcher.run_when_idle), so one request sees one weight version.

Departures:
1. Precision: the trainer runs fp32; the engine by default serves bf16-ROUNDED weights in fp32 compute
   (--weight-dtype bf16), a cheap emulation of the bf16-inference vs fp32-trainer mismatch PPO and R3 must absorb.
2. A distributed publish is applied once every weight of the model has arrived (SGLang loads each bucket as it
   comes), through the checkpoint loader (a temporary safetensors file) for the Hub-to-fused expert conversion.
"""
import contextlib
import math
import os
import tempfile

import safetensors.torch
import torch

import infra
from engine.httpjson import BadRequest, HTTPError
from model import drop_engine_layers, hub_state_dict, load_weights_from_disk, round_to_bf16


class Weights:
    """The model's weights as the engine serves them: bf16-rounded (weight_dtype "bf16") or fp32; the memory tags
    released (SGLang's "weights", "kv_cache"); stale once "weights" came back uninitialised and nothing was loaded
    since; and the trainer's weight groups this engine joined, with the tensors received so far."""

    def __init__(self, model, weight_dtype):
        """model: freshly loaded; rounded to bf16 here when served bf16."""
        self.model, self.weight_dtype = model, weight_dtype
        if weight_dtype == "bf16":
            round_to_bf16(model)
        self.hub_shapes = {k: tuple(v.shape) for k, v in hub_state_dict(model).items()}  # what a publish sends
        self.hub_bytes = 4 * sum(math.prod(s) for s in self.hub_shapes.values())
        self.groups, self.pending = {}, {}  # group name -> process group; -> tensors received so far
        self.released, self.stale = set(), False  # /release_memory_occupation tags; weights not reloaded
        self._shapes = {}  # parameter -> (shape, dtype) while "weights" is released

    def refusal(self):
        """Why /generate is refused (HTTP 409), or None: memory released, or weights not reloaded since resumed."""
        if not (self.released or self.stale):
            return None
        return (f"engine: memory released ({', '.join(sorted(self.released)) or 'weights'}); "
                "POST /resume_memory_occupation, then load weights, before /generate")

    # -- a checkpoint directory --
    def load(self, path):
        """Load a checkpoint directory into the model in place (rounded to bf16 when served bf16)."""
        if "weights" in self.released:
            raise HTTPError(409, "weights: released; POST /resume_memory_occupation before loading weights")
        load_weights_from_disk(self.model, path)
        if self.weight_dtype == "bf16":
            round_to_bf16(self.model)
        drop_engine_layers(self.model)  # engine_forward's copies are rebuilt from the new weights
        self.stale = False

    # -- memory (SGLang's /release_memory_occupation, /resume_memory_occupation: the colocated preset) --
    def release(self, tags):
        """"weights" in tags: free the parameters' storage (engine_forward's copies go too); record the tags."""
        if "weights" in tags and "weights" not in self.released:
            self._shapes = {p: (tuple(p.shape), p.dtype) for p in self.model.parameters()}
            for p in self._shapes:
                p.data = torch.empty(0, dtype=p.dtype)
            drop_engine_layers(self.model)
        self.released |= tags
        return sorted(self.released)

    def resume(self, tags):
        """"weights" comes back uninitialised, as SGLang's: stale until new weights are loaded."""
        if "weights" in tags and "weights" in self.released:
            for p, (shape, dtype) in self._shapes.items():
                p.data = torch.empty(shape, dtype=dtype)
            self.stale = True
        self.released -= tags
        return sorted(self.released)

    # -- weights over a process group (SGLang's /init_weights_update_group, /update_weights_from_distributed) --
    def join_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        """Join the trainer's weight group as rank rank_offset (this engine is one rank: TP 1). Blocks until every
        member has joined (the trainer joins as rank 0 at the same time)."""
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend: nccl needs CUDA; this engine runs on the CPU (use gloo)")
        if group_name in self.groups:  # a trainer that died without /destroy_weights_update_group: its
            self.leave_group(group_name)  # successor (a resumed run) takes the name over
        self.groups[group_name] = infra.init_update_group(master_address, master_port, rank_offset, world_size,
                                                          group_name, backend)
        self.pending[group_name] = {}

    def receive(self, group_name, names, dtypes, shapes):
        """Receive one bucket: every tensor is received (broadcast from rank 0) even when the bucket is refused, so
        the group stays in step. -> the complete state (Hub names) once every weight of the model has arrived, else
        None."""
        import torch.distributed as dist
        announced = sum(math.prod(shape) * getattr(torch, dt).itemsize for dt, shape in zip(dtypes, shapes))
        if announced > 2 * self.hub_bytes:  # refused before anything is allocated or received
            raise BadRequest(f"shapes: the bucket announces {announced} bytes, over twice the model's "
                             f"{self.hub_bytes} (fp32)")
        if group_name not in self.groups:
            raise BadRequest(f"group_name: {group_name!r} was not joined (POST /init_weights_update_group first)")
        pg, got, want = self.groups[group_name], self.pending[group_name], self.hub_shapes
        errors = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=getattr(torch, dt))
            dist.broadcast(t, src=0, group=pg)
            if name not in want:
                errors.append(f"names: {name!r} is not a weight of this model")
            elif tuple(shape) != want[name]:
                errors.append(f"shapes: {name} is {tuple(shape)}, the model's is {want[name]}")
            got[name] = t
        if errors:
            got.clear()  # nothing of a refused publish is applied
            raise BadRequest("; ".join(errors[:3]))
        if set(got) != set(want):
            return None
        state, self.pending[group_name] = dict(got), {}
        return state

    def leave_group(self, group_name):
        import torch.distributed as dist
        pg = self.groups.pop(group_name, None)
        self.pending.pop(group_name, None)
        if pg is None:
            return False
        dist.destroy_process_group(pg)
        return True


@contextlib.contextmanager
def as_checkpoint(state, config):
    """A received state (Hub names) as a temporary checkpoint directory, for the checkpoint loader (Hub names,
    experts one by one, converted to the fused layout)."""
    with tempfile.TemporaryDirectory(prefix="t1_engine_weights_") as d:
        safetensors.torch.save_file({k: v.float().contiguous() for k, v in state.items()},
                                    os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(d)
        yield d
