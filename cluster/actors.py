"""The Ray actors of one training run (train_t1.train), at both scales: the trainer group (trainer.py: actor and
critic co-resident, one actor per rank), the engines (engine/server.py's EngineActor; the cluster's SGLang servers
join by URL instead) and the rollout workers (rollout.py: trials in sandboxes). infra.py lays them out (one
placement group: a bundle per trainer rank, per engine, per rollout worker); this module starts them, runs trials
on them, moves the colocated engines' memory, publishes weights and stops them.

    ax = Actors(args, run_dir)      # Ray started (or joined), the placement groups made
    ax.start(sft_dir, step)         # trainer group, engines, rollout workers; the weight-publish link
    ...                             # ax.trainer.train_step.remote(...), run_rollouts(..., ax.workers, ax.urls)
    ax.stop()                       # whatever started, stopped
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import infra
from chat_tokens import IM_END
import rollout
from engine import server
from engine.client import EngineClient
from rundir import log
from trainer import TrainerGroup, actor_threads


class Actors:
    """A run's Ray actors, filled in as they start (stop() stops whatever started)."""

    def __init__(self, args, run_dir: Path):
        self.args, self.dir = args, Path(run_dir)
        self.ext_urls = [u for u in args.engine_urls.split(",") if u]  # the cluster's servers, already running
        self.n_eng = 0 if self.ext_urls else args.n_engines
        self.ray = infra.ray_start(args.trainer_ranks + self.n_eng + args.rollout_actors, args.ray_address,
                                   actor_threads(args))
        self.pgs, self.place = infra.ray_layout(self.n_eng, args.rollout_actors, n_trainers=args.trainer_ranks)
        self.engines, self.trainer, self.workers, self.urls = [], None, [], []

    def start(self, sft_dir: Path, step: int) -> None:
        """The trainer group (from the SFT checkpoint, resuming after RL step `step`), the engines and the rollout
        workers; then the weight-publish link (the cluster: one process group to the engine ranks; else from disk)."""
        args, ray, place, sft_dir = self.args, self.ray, self.place, str(sft_dir)
        cores = infra.core_split()[1] if args.pin_cores else None  # the rollout side's half (--pin-cores)
        # every actor's process starts before anything waits (the trainer group waits for its ranks' rendezvous):
        # the engines' and rollout workers' imports and loads run beside the trainer ranks'
        self.engines = [ray.remote(server.EngineActor).options(**place["engines"][i]).remote(
            sft_dir, args.engine_weight_dtype, actor_threads(args), cores=cores) for i in range(self.n_eng)]
        self.workers = rollout.ray_rollout_workers(args.rollout_actors,
                                                   math.ceil(args.rollout_workers / args.rollout_actors), sft_dir,
                                                   place["workers"], cores)
        self.trainer = TrainerGroup(ray, args, sft_dir, step, place["trainers"])
        infos = ray.get([e.info.remote() for e in self.engines])
        self.urls = self.ext_urls or [i["url"] for i in infos]
        ranks = ray.get([t.pid.remote() for t in self.trainer.ranks])
        log(self.dir, f"ray actors: trainer pid {ranks[0]}, other trainer ranks pids {ranks[1:]}, engines "
                      f"{infos or self.urls}, rollout workers pids {ray.get([w.pid.remote() for w in self.workers])}")
        sizes = [int(x) for x in args.engine_world_sizes.split(",") if x]  # cluster: weights over one process group
        ray.get(self.trainer.connect_engines.remote(self.urls, sizes))  # else the engines load ckpt/latest from disk
        log(self.dir, f"publish: {'over one process group to engine ranks ' + str(sizes) if sizes else 'from disk'}")

    def publish(self, version: int) -> None:
        """Publish barrier: pause generation, the engines get weights `version`, resume; the trainer keeps a copy."""
        self.ray.get(self.trainer.publish.remote(version))

    def engines_memory(self, action: str, tags=None) -> None:
        """--colocate: every engine releases ("release") or takes back ("resume") its device memory, SGLang's tags
        ("weights", "kv_cache"; None: both)."""
        for u in self.urls:
            client = EngineClient(u)
            out = client.release_memory(tags) if action == "release" else client.resume_memory(tags)
            if not out.get("success"):
                raise RuntimeError(f"engine {u}: {action} memory {tags or 'all'}: {out}")
        log(self.dir, f"engines {action} memory: {', '.join(tags or server.MEMORY_TAGS)}")

    def stop(self) -> None:
        """Stop the engines and the trainer group (30 s each), remove the placement groups, leave Ray."""
        for h in self.engines + ([self.trainer] if self.trainer is not None else []):
            try:
                self.ray.get((h.close if h is self.trainer else h.stop).remote(), timeout=30)
            except Exception:
                pass
        infra.ray_stop(self.pgs)


def run_rollouts(task_dirs, agent, args, run_dir: Path, tokenizer, workers=None, urls=None, n_keep=None,
                 temperature=None, top_p=None, desc="rollout", limits=None, script_faults=0.0):
    """Trials on the Ray rollout workers (rollout.ray_run_trials), or in this process when workers is None
    (the SFT data, before any engine); returns (kept trials, dropped, tokens/s). --deterministic: one trial at a
    time in launch order, the first n_keep kept: the engine's batches (one row) and its sampler's draws then do not
    depend on which trial finished first, so a seed reruns to the digit (slower: nothing runs side by side).
    limits: overrides of the training limits (the evaluation protocol's). Every trial is scored with S =
    --reward-scale. script_faults: the scripted agent's fault rate (--sft-faults)."""
    sampling = {"temperature": args.temperature if temperature is None else temperature,
                "top_p": args.top_p if top_p is None else top_p,
                "max_new_tokens": args.max_new_tokens,
                "stop_token_ids": [tokenizer.convert_tokens_to_ids(IM_END)]}
    limits = {"max_turns": args.max_turns, "max_total_tokens": args.max_total_tokens,
              "trial_timeout_s": args.trial_timeout_s, "trial_mem_bytes": args.trial_mem_bytes,
              "disk_bytes": args.trial_disk_bytes, "disk_inodes": args.trial_disk_inodes,
              "keep_bytes": args.trial_keep_bytes, **(limits or {})}
    kw = dict(sampling=sampling, limits=limits, work_root=str(Path(run_dir) / "trials"), sandbox=args.sandbox,
              reward_scale=args.reward_scale, **({"script_faults": script_faults, "seed": args.seed}
                                                 if script_faults else {}))
    t0 = time.time()
    if workers is None:  # this process's threads: the scripted SFT data (no engine), or one engine's (bench evaluate)
        if len(urls or []) > 1:
            raise ValueError(f"run_rollouts: trials in this process use one engine, got {len(urls)} urls")
        kept, dropped = rollout.run_trials([str(d) for d in task_dirs], agent, n_keep=n_keep, tokenizer=tokenizer,
                                           max_workers=args.rollout_workers, desc=desc,
                                           engine_url=urls[0] if urls else None, **kw)
    elif args.deterministic:  # one trial at a time in launch order, the first n_keep kept (not the first finished)
        kept, dropped, urls = [], [], list(urls or [None])
        for i, d in enumerate(task_dirs):
            if n_keep is not None and len(kept) >= n_keep:
                dropped.append({"task": Path(d).name, "seconds": 0.0, "reason": "not started (--deterministic)"})
                continue
            k, dr = rollout.ray_run_trials([workers[i % len(workers)]], [d], agent,
                                           engine_urls=[urls[i % len(urls)]], desc=desc, **kw)
            kept, dropped = kept + k, dropped + dr
    else:
        kept, dropped = rollout.ray_run_trials(workers, task_dirs, agent, n_keep=n_keep, engine_urls=urls, desc=desc,
                                               **kw)
    for t in kept:  # one reward: every trial scored with this run's S
        if t.get("reward_scale", args.reward_scale) != args.reward_scale:
            raise ValueError(f"trial of task {t.get('task')!r}: scored with S = {t['reward_scale']}, "
                             f"--reward-scale is {args.reward_scale}")
    n_tok = sum(len(r["output_ids"]) for t in kept for r in t.get("records", []))
    return kept, dropped, n_tok / max(time.time() - t0, 1e-9)


def engine_errors_500(urls) -> int | None:
    """HTTP 500s the engines have answered since they started (the embedded engine's /get_server_info counts them and
    logs each with its traceback); None where an engine does not count them (SGLang: its own log) or cannot answer."""
    total = 0
    for url in urls or ():
        try:
            n = EngineClient(url).server_info().get("errors_500")
        except (OSError, RuntimeError, ValueError):
            return None
        if not isinstance(n, int):
            return None
        total += n
    return total
