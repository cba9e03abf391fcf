"""tests/gloo_pool.py: the Megatron tests' rank processes, kept between calls, start each call as a fresh spawn would
(no Megatron parallel state, a process group of their own) and are discarded after a failure."""
import os

import pytest
import torch

import gloo_pool

pytestmark = pytest.mark.ranks  # on tests/gloo_pool.py's kept ranks: one unit with the others (tests/suite_order.py)


def _pid_and_sum(rank, world):
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # the call's own group joins every rank
    return os.getpid(), float(t)


def _megatron_state(rank, world, tp):
    from megatron.core import parallel_state
    was = parallel_state.model_parallel_is_initialized()
    if tp:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return was


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return os.getpid()


def _die_on_rank_0(rank, world):
    if rank == 0:
        os._exit(3)  # a crash: no answer, no exception
    return os.getpid()


def test_ranks_are_kept_and_start_each_call_fresh():
    gloo_pool.close(2)  # a 4-rank pool the modules before this one left is kept for those after it
    first = gloo_pool.ranks(_pid_and_sum, 2, timeout_s=120)
    again = gloo_pool.ranks(_pid_and_sum, 2, timeout_s=120)
    assert [p for p, _ in first] == [p for p, _ in again] and all(s == 3.0 for _, s in first + again)  # kept
    assert gloo_pool.ranks(_megatron_state, 2, 2, timeout_s=120) == [False, False]
    assert gloo_pool.ranks(_megatron_state, 2, 0, timeout_s=120) == [False, False]  # destroyed after the call


def test_a_failed_call_names_the_rank_and_the_next_gets_fresh_processes():
    pids = [p for p, _ in gloo_pool.ranks(_pid_and_sum, 2, timeout_s=120)]
    with pytest.raises(RuntimeError, match=r"rank 1: ValueError\('rank 1 refuses'\)"):
        gloo_pool.ranks(_fail_on_rank_1, 2, timeout_s=120)
    after = [p for p, _ in gloo_pool.ranks(_pid_and_sum, 2, timeout_s=120)]
    assert not set(after) & set(pids)
    assert not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in pids)


def test_a_rank_that_dies_without_answering_fails_the_call():
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] died without answering"):
        gloo_pool.ranks(_die_on_rank_0, 2)  # no timeout: the death alone ends the wait
    assert len(gloo_pool.ranks(_pid_and_sum, 2, timeout_s=120)) == 2


def test_a_rendezvous_that_fails_names_the_rank_at_once(monkeypatch):
    """A rank whose group does not form (here the ranks are sent a port no store can be on) answers with the error
    and the call ends on it, not at its timeout; the next call gets a fresh pool."""
    import time
    import infra

    class NoStore:
        port = 70000  # above 65535: the ranks' TCPStore refuses it at once
    monkeypatch.setattr(infra, "host_store", NoStore)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank [01]: .*70000"):  # the first to answer
        gloo_pool.ranks(_pid_and_sum, 2, timeout_s=120)
    assert time.monotonic() - t0 < 50  # the rendezvous' own timeout is 60 s
    monkeypatch.undo()
    assert len(gloo_pool.ranks(_pid_and_sum, 2, timeout_s=120)) == 2  # a fresh pool
