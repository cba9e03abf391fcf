"""experiments.ranks.gloo_ranks for the tests, with the rank processes kept: `ranks(fn, world, *args)` runs
fn(rank, world, *args) on `world` processes joined by a fresh gloo group, as gloo_ranks does, but the processes are
spawned once per world size and pytest process and reused by the next call: a Megatron rank spends most of a small
test importing torch, Megatron-Core, transformers and the test module (results/LOG.md, 2026-12-07: the Megatron
modules' tests).

Each call runs in a rank as experiments.ranks.run_rank runs it in a spawned one (its own default group, destroyed at
the end).
Then the rank puts back what a call may leave: Megatron's parallel state is destroyed, cluster/mcore_cpu's one-time
set-up is marked undone (its shims are idempotent; a call that relies on init_cpu() for the default parallel state
gets it again). torch's RNG is left as the call left it: a fresh process starts from a random seed too, so no caller
can rely on it. A call whose rank fails or times out discards the pool (its ranks killed): the next call spawns fresh
processes, so one test's failure cannot leak into another's. The wait is experiments.ranks.answers: a rank's error (its
group's rendezvous too) ends the call at once, naming the rank; a timeout names the ranks that did not answer."""
import atexit
import os
import queue
import sys

import torch.multiprocessing as mp

import infra
from experiments.ranks import answers, run_rank

_POOLS = {}  # world -> (processes, task queues, result queue)


def _reset():
    """What a call may leave in a rank, put back (see the module docstring)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    cpu = sys.modules.get("cluster.mcore_cpu")
    if cpu is not None:
        cpu._CPU_READY = False


def _rank_loop(rank, world, tasks, results, parent):
    while True:
        try:
            job = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the pytest process is gone (killed: no atexit ran)
                return
            continue
        if job is None:
            return
        fn, args, port = job
        try:  # one call as gloo_ranks' spawned rank makes it: its group, fn, the answer or the error
            run_rank(fn, rank, world, port, results, args)
        except Exception:  # already answered with its repr; the rank lives on for the next call
            pass
        finally:
            _reset()


def close(world=None, kill=False):
    """Stop the pool of `world` ranks (every pool: None); kill: at once (a discarded pool, whose ranks may be stuck
    in a collective with a dead one: asked to stop, such a rank held the caller until its join timed out)."""
    for w in [world] if world is not None else list(_POOLS):
        procs, tasks, _ = _POOLS.pop(w, ([], [], None))
        for pr, q in zip(procs, tasks):
            if pr.is_alive() and not kill:
                q.put(None)
        for pr in procs:
            if kill:
                pr.kill()
            pr.join(timeout=10)
            if pr.exitcode is None:
                pr.kill()


atexit.register(close)


def ranks(fn, world: int, *args, timeout_s: float | None = None):
    """gloo_ranks(fn, world, *args, timeout_s=...) on the kept processes -> the ranks' return values in rank
    order; a rank's exception is raised here (and the pool discarded)."""
    if world not in _POOLS or not all(pr.is_alive() for pr in _POOLS[world][0]):
        close(world)
        ctx = mp.get_context("spawn")
        tasks, results = [ctx.Queue() for _ in range(world)], ctx.Queue()
        procs = [ctx.Process(target=_rank_loop, args=(r, world, tasks[r], results, os.getpid()),
                             daemon=True)
                 for r in range(world)]
        for pr in procs:
            pr.start()
        _POOLS[world] = (procs, tasks, results)
    procs, tasks, results = _POOLS[world]
    store = infra.host_store()  # held until the call returns: the ranks' rendezvous
    for q in tasks:
        q.put((fn, args, store.port))
    try:
        return answers(results, procs, timeout_s)
    except BaseException:  # a failed call discards the pool: its ranks may be stuck in a collective
        close(world, kill=True)
        raise
