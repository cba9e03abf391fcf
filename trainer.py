"""The trainer process: actor + critic co-resident (paper) on Ray actors, ranks, checkpoints, the publish barrier.

Machinery for steps 5-7: `Trainer` holds the actor, the behaviour copy, the critic, both optimizers and the
published weight versions; its methods call ppo.critic_warmup and ppo.train_step (the update itself, ppo.py), save
the step's checkpoint (rundir.save_trainer: the run directory's commit point is state.json, written by the loop)
and publish the weights to the engines (the barrier of step 7). `TrainerGroup` fans the loop's calls out to N
trainer ranks, with the hf backend (full replicas) or the Megatron backend (cluster/) that this file drives.

Run: not by itself; `python train_t1.py` starts it (tests/test_trainer_group.py, tests/test_resume.py).

Departures (numbered; what and why):
  1. hf backend over N ranks: full replicas (pure DP, no optimizer sharding) in their own process group (gloo;
     nccl for CUDA weights). Sample i lives on rank i mod N (dp.py); losses divide by the minibatch's global token
     count and gradients are summed before the clip, so a step equals the one-rank step.
  2. Rank 0 saves and publishes, every rank keeps the published copies; losses, clip fractions, EV and |dlogp|
     are over all ranks, expert_set_mismatch over rank 0's samples.
  3. megatron backend over tp * pp * cp * dp ranks (join_group): parallel_state carves the group per --plan; each
     rank builds its shards, read from the checkpoint's safetensors by slices (no rank holds the whole model).
  4. megatron gradients: Megatron DDP + the distributed optimizer: Megatron's own on CUDA (mcore_parallel.MegatronAdam),
     mcore_parallel.ShardedAdam on the CPU (Megatron's refuses CPU tensors); bf16 parameters with --param-dtype bf16
     (fp32 master shards). Rows are shared over the DP ranks only, padded to equal shares with dummy rows of mask 0
     (a forward is a collective over the expert-parallel ranks).
  5. megatron checkpoint: the HF checkpoint (and a publish's weights) gathered tensor by tensor to global rank 0
     alone, which writes it; each rank writes its shard file trainer_rank{r}.pt (its fp32 masters and moments; the
     plan and --param-dtype are checked on resume), not Megatron's dist_checkpointing: resumable on the same plan
     only (Megatron's would reshard), one torch.save per rank and no extra dependency.
  6. An expert no token reached gets a zero gradient (Adam still moves it by its momentum) where the one-rank
     torch Adam skips a grad of None: Megatron's behaviour.
"""
from __future__ import annotations

import copy
import json
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import critic as C
import infra
import model as M
import ppo
from cluster import mcore, mcore_parallel, mcore_weights, publish
from engine.client import DiskPublisher
from rundir import load_trainer_file, log, save_trainer


def optimizer_lr(opt) -> float:
    """The lr an optimizer steps at: torch's (one lr for every param group here), ShardedAdam's, MegatronAdam's."""
    return opt.lr if hasattr(opt, "set_lr") else opt.param_groups[0]["lr"]


def set_optimizer_lr(opt, lr: float) -> None:
    """The flags' lr over a loaded optimizer state: load_state_dict restores the lr the checkpoint was saved with
    (torch's param_groups, ShardedAdam's and Megatron's alike), so a resume or a warmed critic with another --actor-lr /
    --critic-lr kept the old one without a word; the trainer sets the flags' lr and logs the change."""
    if hasattr(opt, "set_lr"):
        opt.set_lr(lr)
    else:
        for group in opt.param_groups:
            group["lr"] = lr


# --- the trainer's layout ---------------------------------------------------------------------------

def parallel_plan(args) -> dict:
    """The trainer's layout: --plan (infra.py's planner JSON: tp, pp, cp, ep, etp, dp) or --trainer-ranks N
    full replicas (dp = N); world = tp * pp * cp * dp trainer ranks."""
    try:
        plan = json.loads(args.plan) if args.plan else {"dp": args.trainer_ranks}
        p = {k: int(plan.get(k, 1)) for k in ("tp", "pp", "cp", "ep", "dp")}
        p["etp"] = int(plan.get("etp", p["tp"]))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--plan: expected JSON like '{{\"tp\": 2, \"ep\": 1, \"dp\": 1}}', got {args.plan!r} ({e})")
    if min(p.values()) < 1:
        raise ValueError(f"--plan: every size must be >= 1, got {p}")
    p["world"] = p["tp"] * p["pp"] * p["cp"] * p["dp"]
    return p


def plan_recompute(args) -> bool:
    """--plan's "recompute" (the planner's full activation recompute, which its memory figures assume); not part of
    parallel_plan, as it does not change a rank's shards (checkpoints of either resume in the other)."""
    plan = json.loads(args.plan) if args.plan else {}
    r = plan.get("recompute", False) if isinstance(plan, dict) else False
    if not isinstance(r, bool):
        raise ValueError(f"--plan: recompute must be true or false, got {r!r}")
    return r


# --- the trainer actor -------------------------------------------------------------------------------

def actor_threads(args) -> int:
    """torch threads of the trainer and of each engine (Args.torch_threads)."""
    cores = os.cpu_count() or 1
    return args.torch_threads or (max(1, cores // 2) if args.async_rollout else min(2, cores))


class Trainer:
    """Actor + critic co-resident (paper), both optimizers, RNG, the behaviour copy of the actor, and the weights of
    the last two versions the engines served (the behaviour policy of a batch; in host memory). Runs as a Ray actor;
    its methods are steps 5-7.
    Rank r of a TrainerGroup of `world` ranks: with the hf backend full replicas (pure data parallel; rank 0
    saves and publishes); with the megatron backend Megatron's parallel layout of --plan (parallel_state: TP,
    EP and DP over the ranks; DDP + the distributed optimizer; every rank takes part in the gather that saves
    and publishes, rank 0 writes). A multi-rank trainer builds its models once the group is joined."""

    def __init__(self, args, sft_dir: str, step: int, rank: int = 0, world: int = 1):
        if args.pin_cores:  # the trainer's half of the cores, the rollout side has the other (infra.core_split)
            infra.pin(infra.core_split()[0])
        torch.set_num_threads(actor_threads(args))
        torch.manual_seed(args.seed)
        self.args, self.run_dir, self.sft_dir, self.step0 = args, Path(args.run_dir), sft_dir, step
        self.latest = self.run_dir / "ckpt" / "latest"
        self.rank, self.world, self.group, self.store = rank, world, None, None  # store: rank 0 serves it (address)
        self.sharded = args.backend == "megatron" and world > 1  # each rank holds shards (Megatron's layout)
        self.ckpt_name = f"trainer_rank{rank}.pt" if self.sharded else "trainer.pt"
        self.published = {}  # weight version -> the actor's state dict the engines were given
        self.ref = None  # the frozen SFT actor (kl_coef > 0, hf backend)
        self.publisher, self.push_weights = None, False
        if not self.sharded:
            self._build()

    def _build(self) -> None:
        """Actor, behaviour copy, critic and their optimizers from the SFT (or latest) checkpoint; on resume the
        critic, optimizers and RNG of this rank's checkpoint file."""
        args, step = self.args, self.step0
        src = self.latest if step > 0 else self.sft_dir
        if args.backend == "megatron":  # Megatron-Core GPTModels converted from the HF checkpoint (cluster/mcore.py)
            cfg, self.tokenizer = M.load_config(src)  # no HF weights in memory: each rank reads its shards
            self.hf_config = cfg
            self.actor, self.behaviour, self.critic = mcore.trainer_models(  # this rank's shards
                cfg, src, args.param_dtype, plan_recompute(args))
            self.save_actor = lambda path: mcore_weights.save_hf(self.actor, cfg, self.tokenizer, path)  # a gather
            def hub_weights():  # a collective gathered to global rank 0; the other ranks get {}
                hf = mcore_weights.to_hf(self.actor, cfg, to_rank0=True)
                return {} if hf is None else M.hub_state_dict(hf)
            self.hub_weights = hub_weights
        else:
            hf_actor, self.tokenizer = M.load_actor(src)
            self.hf_config = hf_actor.config
            self.actor, self.behaviour = hf_actor, copy.deepcopy(hf_actor)  # behaviour: weights that sampled a batch
            self.critic = C.Critic.from_actor(self.actor, args.critic_head_init)  # full-size, the actor's backbone
            if args.kl_coef > 0:  # the frozen SFT actor: the KL reference, built only when it is used
                self.ref = M.load_actor(self.sft_dir)[0].eval().requires_grad_(False)
            self.save_actor = lambda path: M.save_checkpoint(self.actor, self.tokenizer, path)
            self.hub_weights = lambda: M.hub_state_dict(self.actor)
        if args.backend == "megatron" and (self.sharded or args.param_dtype == "bf16" or torch.cuda.is_available()):
            # Megatron DDP (grads reduce-scattered over DP, fp32) + the distributed optimizer (fp32 master shards of
            # bf16 parameters): Megatron's own on CUDA, mcore_parallel's ZeRO-1 of the same buckets on the CPU
            opt = mcore_parallel.MegatronAdam if torch.cuda.is_available() else mcore_parallel.ShardedAdam
            self.actor_opt = opt(mcore_parallel.wrap_ddp(self.actor), lr=args.actor_lr)
            self.critic_opt = opt(mcore_parallel.wrap_ddp(self.critic), lr=args.critic_lr)
        else:
            self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=args.actor_lr)
            self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=args.critic_lr)
        self.rng = random.Random(args.seed + 2)  # minibatch order; saved with every checkpoint
        warm = self.run_dir / "ckpt" / self.ckpt_name.replace("trainer", "critic_warm")
        if step > 0:
            ck = self._load(self.latest / self.ckpt_name, step)
            self.critic.load_state_dict(ck["critic"])
            self.actor_opt.load_state_dict(ck["actor_opt"])
            self.critic_opt.load_state_dict(ck["critic_opt"])
            self.rng.setstate(ck["rng"])
            torch.set_rng_state(ck["torch_rng"])
        elif warm.exists():
            ck = self._load(warm)
            self.critic.load_state_dict(ck["critic"])
            self.critic_opt.load_state_dict(ck["critic_opt"])
        for flag, o, lr in (("--actor-lr", self.actor_opt, args.actor_lr), ("--critic-lr", self.critic_opt,
                                                                              args.critic_lr)):
            old = optimizer_lr(o)
            if old != lr:  # the optimizer's load_state_dict brought back the lr it was saved with
                set_optimizer_lr(o, lr)
                if self.rank == 0:
                    log(self.run_dir, f"{flag} {lr}: the loaded optimizer ran at {old}, from here it runs at {lr}")

    def _load(self, path: Path, step: int | None = None) -> dict:
        ck = load_trainer_file(path)
        if step is not None and ck.get("step") != step:  # resume_run keeps ckpt/latest at the committed step
            raise ValueError(f"{path}: holds RL step {ck.get('step')}, state.json committed step {step}")
        plan = parallel_plan(self.args)
        if self.sharded and ck.get("plan") != plan:  # the shards of another layout do not fit this one
            raise ValueError(f"--plan: {path} holds shards of the layout {ck.get('plan')}, this run asks for {plan}")
        if ck.get("param_dtype", "fp32") != self.args.param_dtype:  # bf16's fp32 masters would be lost, or missing
            raise ValueError(f"--param-dtype: {path} was trained with {ck.get('param_dtype', 'fp32')}, this run asks "
                             f"for {self.args.param_dtype}")
        return ck

    def _state(self, step: int) -> dict:
        """What this rank checkpoints besides the actor (HF layout): critic, optimizers, step, RNG (and the plan)."""
        return {"critic": self.critic.state_dict(), "actor_opt": self.actor_opt.state_dict(),
                "critic_opt": self.critic_opt.state_dict(), "step": step, "rng": self.rng.getstate(),
                "torch_rng": torch.get_rng_state(), "plan": parallel_plan(self.args) if self.sharded else None,
                "param_dtype": self.args.param_dtype}

    def _barrier(self) -> None:
        if self.sharded:
            import torch.distributed as dist
            dist.barrier()

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Where the trainer ranks meet: this (rank 0's) node and the port of the rendezvous store this rank serves
        from now on (infra.host_store: the port is held, no other process can take it before the ranks join)."""
        import ray
        self.store = infra.host_store()
        return (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"), self.store.port

    def join_group(self, address: str, port: int) -> None:
        """The trainer ranks' own process group (gloo on CPU, nccl for CUDA weights). hf: apart from any other, for
        the replicas' gradient sums. megatron: the default group of this process, carved by parallel_state into
        Megatron's TP / EP / DP groups per --plan; the models are built on it (this rank's shards)."""
        import datetime
        import torch.distributed as dist
        backend, timeout = "nccl" if torch.cuda.is_available() else "gloo", datetime.timedelta(minutes=30)
        # every rank a client of the store rank 0 serves (address): the same keys on every rank
        store = dist.TCPStore(address, port, self.world, is_master=False, timeout=timeout)
        if not self.sharded:
            self.group = infra.init_update_group(address, port, self.rank, self.world, "t1_trainer_dp", backend,
                                                 store=store)
            return
        from megatron.core import parallel_state as ps
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        p = parallel_plan(self.args)
        ps.initialize_model_parallel(tensor_model_parallel_size=p["tp"], pipeline_model_parallel_size=p["pp"],
                                     context_parallel_size=p["cp"], expert_model_parallel_size=p["ep"],
                                     expert_tensor_parallel_size=p["etp"])
        self.group = ps.get_data_parallel_group()  # rows of a batch are shared out over the DP ranks only
        self._build()

    def state_dicts(self, to_rank0: bool = False) -> dict:
        """Actor and critic weights of this rank (tests compare ranks); megatron: the whole TP = EP = 1 GPTModel
        state dicts, gathered over the ranks when sharded (a collective: every rank calls it); to_rank0: gathered to
        global rank 0 alone, as save and publish do (the other ranks get None per part)."""
        if self.args.backend == "megatron":
            return {part: mcore_weights.gather_full_state(m.gpt, self.hf_config, to_rank0)
                    for part, m in (("actor", self.actor), ("critic", self.critic))}
        return {"actor": self.actor.state_dict(), "critic": self.critic.state_dict()}

    def optimizer_state_numel(self) -> dict:
        """Adam elements per moment this rank holds for the actor ({"dense", "expert"}; sharded trainers only)."""
        return self.actor_opt.state_numel()

    def mark_published(self, version: int) -> None:
        """Keep the weights of `version` (the behaviour policy of the next batches) in host memory, pinned when the
        actor is on a GPU, as slime's TensorBackuper keeps its actor / ref snapshots: the device holds only the
        actor and the behaviour copy (infra.device_memory counts both; the published versions are its `host`)."""
        def host_copy(v):
            if not torch.is_tensor(v):
                return v
            return torch.empty_like(v, device="cpu", pin_memory=v.is_cuda).copy_(v.detach())
        self.published[version] = {k: host_copy(v) for k, v in self.actor.state_dict().items()}
        for old in [v for v in self.published if v < version - 1]:
            del self.published[old]

    def connect_engines(self, urls: list, world_sizes: list, master_address: str = "") -> None:
        """The publisher of this run (every rank learns which; rank 0 alone speaks to the engines): with
        world_sizes (cluster) rank 0 of one group with every engine rank (cluster.publish.WeightPublisher, NCCL; gloo on
        CPU), else the embedded engines load ckpt/latest from disk (engine.client.DiskPublisher)."""
        self.push_weights = bool(world_sizes)
        if self.rank > 0:
            return
        if not world_sizes:
            self.publisher = DiskPublisher(urls, self.latest)
            return
        if not master_address:
            import ray
            master_address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.publisher = publish.WeightPublisher(
            [publish.SGLangClient(u) for u in urls], world_sizes, master_address,
            backend="nccl" if torch.cuda.is_available() else "gloo").connect()

    def publish(self, version: int) -> int:
        """Publish barrier (step 7): pause every engine, weights of `version` to them (broadcast under Hub names, or
        from the step's checkpoint on disk), resume; every rank keeps the published copy (mark_published)."""
        if self.rank == 0 and self.publisher is None:
            raise RuntimeError("Trainer.publish: no publisher; connect_engines(urls, world_sizes) comes first")
        gather = self.push_weights and (self.rank == 0 or self.sharded)  # sharded: every rank takes part
        weights = list(self.hub_weights().items()) if gather else None
        n = self.publisher.publish(weights, version) if self.rank == 0 else 0
        self.mark_published(version)
        return n

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.group is not None:
            import torch.distributed as dist
            if self.sharded:
                from megatron.core import parallel_state as ps
                ps.destroy_model_parallel()
                dist.destroy_process_group()
            else:
                dist.destroy_process_group(self.group)
            self.group = None

    def warmup(self, samples: list[dict]) -> list[dict]:
        recs = ppo.critic_warmup(self.critic, self.critic_opt, samples, self.args, self.group) if samples else []
        if self.rank == 0 or self.sharded:  # replicas: one file; shards: one per rank
            out = self.run_dir / "ckpt" / self.ckpt_name.replace("trainer", "critic_warm")
            out.parent.mkdir(parents=True, exist_ok=True)  # a --model-path run has no ckpt/sft to have made it
            torch.save({"critic": self.critic.state_dict(), "critic_opt": self.critic_opt.state_dict(),
                        "plan": parallel_plan(self.args) if self.sharded else None,
                        "param_dtype": self.args.param_dtype}, out.with_suffix(".tmp"))
            os.replace(out.with_suffix(".tmp"), out)  # whole or absent: a kill mid-save leaves no torn file
        return recs

    def train_step(self, samples: list[dict], step: int) -> dict:
        """Steps 5-7 on this step's samples, then the checkpoint (actor, critic, optimizers, step, RNG)."""
        t0 = time.time()
        versions = sorted({int(s["weight_version"]) for s in samples if s["weight_version"] is not None})
        if versions:
            self.behaviour.load_state_dict(self.published[versions[0]])  # the policy that sampled this batch
        stats = (ppo.train_step(self.actor, self.behaviour, self.critic, self.actor_opt, self.critic_opt,
                                samples, self.args, self.rng, self.run_dir, step, self.group, self.ref)
                 if samples else {})
        if self.rank == 0 or self.sharded:  # replicas are identical: one checkpoint; shards: every rank
            save_trainer(self.latest, self.save_actor, self._state(step), self.ckpt_name, self.rank, self._barrier)
        return {**stats, "time_train": time.time() - t0}


class TrainerGroup:
    """The trainer ranks behind the one handle the loop talks to: `group.method.remote(*a)` runs the method
    on every rank (in the same order on each) and returns rank 0's ObjectRef. The ranks move in lockstep
    through their collectives; an error of another rank surfaces at the next call (or hangs rank 0 in a
    collective until the group's timeout, 30 min, if that rank stays alive)."""

    def __init__(self, ray, args, sft_dir: str, step: int, options: list[dict]):
        self.ray, world = ray, len(options)
        self.ranks = [ray.remote(Trainer).options(**o).remote(args, sft_dir, step, r, world)
                      for r, o in enumerate(options)]
        self.others = []  # the other ranks' refs of the last call
        if world > 1:
            address, port = ray.get(self.ranks[0].address.remote())
            ray.get([t.join_group.remote(address, port) for t in self.ranks])

    def __getattr__(self, name: str):
        if name.startswith("_"):  # pickle / copy probes: not a Trainer method
            raise AttributeError(name)

        def remote(*a, **kw):
            done, _ = self.ray.wait(self.others, num_returns=len(self.others), timeout=0) if self.others else ([], [])
            self.ray.get(done)  # raises the error of another rank in the last call
            refs = [getattr(t, name).remote(*a, **kw) for t in self.ranks]
            self.others = refs[1:]
            return refs[0]
        return SimpleNamespace(remote=remote)

