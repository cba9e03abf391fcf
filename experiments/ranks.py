"""Ranks on this machine for the measurements and the tests: fn(rank, world, *args) in `world` spawned processes
joined by one fresh gloo group on 127.0.0.1 (their default process group), the answers gathered in rank order. The
caller serves the group's rendezvous store (infra.host_store) for the call, so its port is held from the pick on and
every rank joins it as a client.

gloo_ranks spawns the processes for one call (experiments/mechanisms.py's context-parallel figures); tests/gloo_pool
keeps them for the next call. Both run a call with run_rank and wait with answers: a rank's error (its group's
rendezvous too) ends the wait at once, naming the rank; a rank that dies without answering ends it too (named first
when its peers report the errors its death caused); a timeout names the ranks that did not answer.

Return numpy arrays, not tensors: numpy pickles by value, a tensor would travel as a file descriptor that dies with
its process."""
import datetime
import queue
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infra import host_store


def run_rank(fn, rank, world, port, results, args):
    """One call in a rank: its gloo group (the default one, destroyed at the end) on the caller's store at `port`,
    fn, then (rank, answer, None) or (rank, None, repr of the error) on `results`; the error is raised again (a
    spawned rank then exits non-zero)."""
    torch.set_num_threads(1)
    try:  # a failed rendezvous is reported too, so the caller fails with the cause, not a timeout
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        results.put((rank, fn(rank, world, *args), None))
    except Exception as e:
        results.put((rank, None, repr(e)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _died_silent(results, res, procs, wait_s: float) -> list:
    """The ranks that ended without answering, what every rank sent before it ended read into `res` first; waits up
    to wait_s for one to end (the peers of a rank that died report the errors its death caused before it counts)."""
    end = time.monotonic() + wait_s
    while True:
        ended = {r for r, pr in enumerate(procs) if not pr.is_alive()}  # before the read: their answers are queued
        try:
            res.append(results.get(timeout=0.2))
            continue
        except queue.Empty:
            pass
        dead = sorted(ended - {r for r, _, _ in res})
        if dead or time.monotonic() >= end:
            return dead


def answers(results, procs, timeout_s: float | None = None) -> list:
    """The answers of the ranks `procs` (one process each, rank = position) from `results` -> their return values in
    rank order. RuntimeError naming the rank(s) at a rank's error, a rank that died without answering, or no answer
    from every rank within timeout_s (None: no bound)."""
    world = len(procs)
    deadline, res = None if timeout_s is None else time.monotonic() + timeout_s, []
    while len(res) < world and not any(err for _, _, err in res):  # the others may wait in a group that won't form
        try:
            res.append(results.get(timeout=1))
        except queue.Empty:  # a rank that dies without answering (a crash, a kill) fails the call here
            dead = _died_silent(results, res, procs, 0) if not all(pr.is_alive() for pr in procs) else []
            if dead or (deadline is not None and time.monotonic() > deadline):
                silent = sorted(set(range(world)) - {r for r, _, _ in res})
                raise RuntimeError(f"gloo ranks: rank(s) {dead} died without answering" if dead else
                                   f"gloo ranks: no answer from rank(s) {silent} in {timeout_s} s")
    errors = [f"rank {r}: {err}" for r, _, err in sorted(res, key=lambda r: r[0]) if err]
    if errors:  # a rank that died first is the cause (its peers' errors follow from it): named
        dead = _died_silent(results, res, procs, 2) if len(res) < world else []
        raise RuntimeError(f"gloo ranks: rank(s) {dead} died without answering; then {errors}" if dead else
                           f"gloo ranks failed: {errors}")
    return [out for _, out, _ in sorted(res, key=lambda r: r[0])]


def gloo_ranks(fn, world: int, *args, timeout_s: float | None = None):
    """fn(rank, world, *args) in `world` spawned processes (one gloo group) -> their return values in rank order; a
    rank's error is raised here (answers), and every rank is stopped before this returns or raises."""
    ctx = mp.get_context("spawn")
    results, store = ctx.Queue(), host_store()
    procs = [ctx.Process(target=run_rank, args=(fn, r, world, store.port, results, args)) for r in range(world)]
    for pr in procs:
        pr.start()
    try:
        out = answers(results, procs, timeout_s)
    except BaseException:
        for pr in procs:
            pr.kill()
        raise
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.exitcode is None:
                pr.kill()
    if any(pr.exitcode != 0 for pr in procs):
        raise RuntimeError(f"gloo ranks: every rank answered, but the exit codes are {[pr.exitcode for pr in procs]}")
    return out
