"""Stress test for engine/batcher.py and engine/kvcache.py: concurrent multi-turn agents (the rollout's traffic: each
turn re-sends the trajectory, its reply and a tool output of random length) whose rows join and leave the running batch
at many batch sizes and prompt lengths, on both architectures, with more agents than the batch holds, a request aborted
mid-decode and a client that hangs up. Every request must answer 200 with a reply that teacher-forced forwards of
the same weights agree with (each output token's logprob, replaying the reply's routing; its routing rows), and the
run must have exercised what it claims (rows joining in place, rows leaving, a full batch, the KV columns growing
with spare rows, prefix hits).

Each agent's schedule (lengths, tokens, sampling seeds, think times) is seeded; the threads' interleaving is not.
"""
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import server as engine_lib  # noqa: E402
from engine import batcher  # noqa: E402
from engine import kvcache  # noqa: E402
import model as model_lib  # noqa: E402
import r3  # noqa: E402

torch.set_num_threads(2)

# (arch, max_batch, agents, turns, seed): fewer agents than rows (rows spare while the batch's KV columns grow), or
# more (a full batch, the queue holds the rest)
SCHEDULES = [("qwen3_moe", 8, 5, 4, 13), ("qwen3_5_moe", 8, 5, 3, 14), ("qwen3_moe", 3, 6, 2, 11),
             ("qwen3_5_moe", 3, 6, 2, 12)]
MAX_NEW = 150  # a turn's max_new_tokens: 1..4 (rows leave almost every step) or 1..MAX_NEW, even odds
LONG_ANSWER = 200  # agent 0's first turn
LOGPROB_ATOL = 1e-4  # a reply's logprobs vs the teacher-forced forward replaying its routing (measured: < 2e-6)
ROUTING_AGREE = 0.98  # of a reply's routing rows equal to a teacher-forced forward's (one near-tie flip in 234 seen)


def post(url, obj, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_running(eng, rid, timeout=60):
    deadline = time.time() + timeout
    while rid not in eng.running and time.time() < deadline:
        time.sleep(0.002)
    return rid in eng.running


def _hang_up(eng, body, rid):
    """Send a /generate and close the connection once its row runs: the engine must abort it (no reply to send)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(eng.httpd.server_address[:2], timeout=30)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    _wait_running(eng, rid)
    s.close()


class Coverage:
    """What the run did to the batch: instrumented kvcache calls (the batcher's names for them)."""

    def __init__(self, monkeypatch, eng):
        self.sizes, self.in_place, self.rebuilt, self.dropped, self.grew_with_spare = set(), 0, 0, 0, 0
        append, drop, update, step = batcher.append_rows, batcher.drop_rows, kvcache.GrowingKV.update, eng._step
        cov = self

        def append_rows(cache, mask, parts):
            out = append(cache, mask, parts)
            cov.in_place, cov.rebuilt = cov.in_place + (out is not None), cov.rebuilt + (out is None)
            return out

        def drop_rows(cache, n_rows, drop_idx):
            cov.dropped += len(drop_idx)
            return drop(cache, n_rows, drop_idx)

        def grow(layer, k, v, *a, **kw):
            if layer.is_initialized and layer.kbuf is not None and layer.n + k.shape[-2] > layer.kbuf.shape[-2] \
                    and layer.kbuf.shape[0] > k.shape[0]:
                cov.grew_with_spare += 1
            return update(layer, k, v, *a, **kw)

        def stepped(admit):
            step(admit)
            cov.sizes.add(len(eng.rows))
        monkeypatch.setattr(batcher, "append_rows", append_rows)
        monkeypatch.setattr(batcher, "drop_rows", drop_rows)
        monkeypatch.setattr(kvcache.GrowingKV, "update", grow)
        monkeypatch.setattr(eng, "_step", stepped)


def _agent(eng, vocab, i, n_turns, seed, log):
    """One agent: turn t sends ids (the previous turn's ids + its reply + a tool output of random length); agent 0
    answers long first, then has a turn aborted mid-decode; agent 1 has a turn whose client hangs up."""
    rng = random.Random(seed * 1000 + i)
    ids = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 50))]
    for t in range(n_turns):
        rid = f"agent{i}-turn{t}"
        sp = {"temperature": rng.choice([0.0, 1.0, 1.0]), "max_new_tokens": rng.choice([rng.randint(1, 4),
                                                                                        rng.randint(1, MAX_NEW)]),
              "ignore_eos": rng.random() < 0.7, "seed": rng.randrange(2**32)}
        body = {"input_ids": ids, "sampling_params": sp, "rid": rid, "return_logprob": True,
                "return_routed_experts": True}
        if (i, t) == (0, 0):  # a long answer: the batch's KV columns grow past their capacity while rows come and go
            sp.update(max_new_tokens=LONG_ANSWER, ignore_eos=True)
        time.sleep(rng.uniform(0, 0.03))  # the tool's run
        if (i, t) == (1, 1):
            body["sampling_params"] = dict(sp, max_new_tokens=400, ignore_eos=True)
            _hang_up(eng, body, rid)
            log.append(("hung up", rid, ids, body, None))
            continue  # the rollout retries the turn's prompt
        if (i, t) == (0, 1):
            body["sampling_params"] = dict(sp, max_new_tokens=400, ignore_eos=True)
            box = {}
            th = threading.Thread(target=lambda: box.setdefault("r", post(eng.url + "/generate", body)))
            th.start()
            _wait_running(eng, rid)
            time.sleep(rng.uniform(0, 0.05))
            post(eng.url + "/abort_request", {"rid": rid})
            th.join(timeout=120)
            status, out = box.get("r", (None, "no reply"))
        else:
            status, out = post(eng.url + "/generate", body)
        log.append(("reply", rid, ids, body, (status, out)))
        if status != 200:
            return
        ids = ids + out["output_ids"] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]


def _check_reply(ids, body, out, n_layers, top_k):
    """A reply consistent with its request -> its routed experts (n_in + n_out - 1, L, k)."""
    meta, n_in, n_out = out["meta_info"], len(ids), len(out["output_ids"])
    sp, finish = body["sampling_params"], meta["finish_reason"]["type"]
    assert meta["id"] == body["rid"] and meta["prompt_tokens"] == n_in and meta["completion_tokens"] == n_out
    assert 0 <= meta["cached_tokens"] < n_in and n_out <= sp["max_new_tokens"]
    assert finish in ("length", "stop", "abort"), finish
    assert finish != "length" or n_out == sp["max_new_tokens"]
    assert finish != "stop" or out["output_ids"][-1] == 2 and not sp["ignore_eos"]
    assert [x[1] for x in meta["output_token_logprobs"]] == out["output_ids"]
    routed = r3.decode_routed_experts(meta["routed_experts"], n_layers, top_k)
    assert routed.shape == (max(n_in + n_out - 1, 0), n_layers, top_k)
    return routed


def _padded(seqs):
    out = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # right-padded: a causal model's real
    for b, seq in enumerate(seqs):  # positions do not see the padding
        out[b, :len(seq)] = torch.tensor(seq)
    return out


def _teacher_forced(ref, logs):
    """Every reply against teacher-forced forwards of the same weights. Routing: an agent's turns are prefixes of
    its last one, so one recording forward over every agent's whole trajectory gives each reply's rows: ROUTING_AGREE
    of them must match (the engine's own forward differs from transformers' by ~1e-6, which can flip a near-tied
    top-k choice). Logprobs: one forward per turn index, replaying each reply's own routed experts (R3, as the
    trainer does, so a flipped near-tie does not move them): every output token's within LOGPROB_ATOL."""
    n_layers, top_k = len(r3.routers(ref)), ref.config.num_experts_per_tok
    agents = [[e for e in log if e[0] == "reply"] for log in logs]
    seqs = [turns[-1][2] + turns[-1][4][1]["output_ids"] for turns in agents]
    with torch.no_grad(), r3.routing(ref, "record") as rec:
        ref(_padded(seqs))
    recorded = rec.experts  # (agents, T, L, k)
    for t in range(max(map(len, agents))):
        group = [(b, turns[t]) for b, turns in enumerate(agents) if len(turns) > t]
        full = _padded([ids + out["output_ids"] for _, (_, _, ids, _, (_, out)) in group])
        experts = recorded[[b for b, _ in group], :full.shape[1]].clone()  # the rows no reply has: as recorded
        for i, (b, (_, rid, ids, body, (_, out))) in enumerate(group):
            routed = torch.from_numpy(_check_reply(ids, body, out, n_layers, top_k))
            assert seqs[b][:len(ids) + len(out["output_ids"])] == ids + out["output_ids"], f"{rid}: not a prefix"
            agree = (recorded[b, :len(routed)] == routed).all(-1).all(-1).float().mean().item() if len(routed) else 1
            assert agree >= ROUTING_AGREE, f"{rid}: {agree:.1%} of routing rows equal a teacher-forced forward's"
            experts[i, :len(routed)] = routed
        with torch.no_grad(), r3.routing(ref, "replay", experts=experts):
            logits = ref(full).logits.double()
        for i, (b, (_, rid, ids, body, (_, out))) in enumerate(group):
            n_in, n_out, T = len(ids), len(out["output_ids"]), body["sampling_params"]["temperature"]
            if n_out == 0:  # aborted before its first token
                continue
            logp = torch.log_softmax(logits[i, n_in - 1:n_in + n_out - 1] / (T or 1.0), -1)  # greedy: raw logits'
            want = logp.gather(1, full[i, n_in:n_in + n_out, None])[:, 0]
            if T == 0:  # greedy: the argmax (up to a near-tie)
                assert (logp.max(-1).values - want).max().item() < LOGPROB_ATOL, f"{rid}: not the argmax"
            got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
            err = (got - want).abs().max().item()
            assert err < LOGPROB_ATOL, f"{rid}: logprobs differ from a teacher-forced forward by {err:.2e}"


@pytest.mark.parametrize("arch,max_batch,n_agents,n_turns,seed", SCHEDULES)
def test_concurrent_multi_turn_agents_every_request_is_answered(tok, tmp_path, monkeypatch, arch, max_batch,
                                                                n_agents, n_turns, seed):
    path = str(tmp_path / arch)
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), arch), seed=seed), tok, path)
    eng = engine_lib.EngineServer(path, port=0, max_batch=max_batch, weight_dtype="fp32").start()
    cov = Coverage(monkeypatch, eng)
    logs = [[] for _ in range(n_agents)]
    t0 = time.time()
    try:
        threads = [threading.Thread(target=_agent, args=(eng, len(tok), i, n_turns, seed, logs[i]))
                   for i in range(n_agents)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        elapsed = time.time() - t0
        deadline = time.time() + 10  # the hung-up request's abort is logged as its handler returns
        while not any(d["rid"] == "agent1-turn1" for d in eng.disconnects) and time.time() < deadline:
            time.sleep(0.01)
        disconnects = list(eng.disconnects)
        stats = eng.cache_stats()
    finally:
        eng.stop()
    replies = [e for log in logs for e in log if e[0] == "reply"]
    bad = [(rid, st) for _, rid, _, _, (st, _) in replies if st != 200]
    assert not bad, f"{len(bad)} of {len(replies)} requests failed: {bad[:3]}"
    assert len(replies) == n_agents * n_turns - 1, "an agent stopped early"
    (hung,) = [d for d in disconnects if d["rid"] == "agent1-turn1"]
    assert hung["finish"] == "abort" and hung["completion_tokens"] < 400, hung
    aborted = next(out for _, rid, _, _, (_, out) in replies if rid == "agent0-turn1")
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort", aborted["meta_info"]["finish_reason"]
    _teacher_forced(model_lib.load_actor(path)[0].eval(), logs)
    # the run exercised what it claims
    assert cov.in_place >= 3 and cov.dropped >= n_agents, vars(cov)
    assert len(cov.sizes) >= 3 and (max_batch in cov.sizes or n_agents < max_batch), cov.sizes
    assert cov.grew_with_spare >= 1 or n_agents > max_batch, vars(cov)  # the spare-rows schedules must reach it
    assert stats["hits"] >= n_agents, stats
    print(f"{arch}: {len(replies)} replies in {elapsed:.1f} s; batch sizes {sorted(cov.sizes)}; "
          f"{cov.in_place} joins in place, {cov.rebuilt} rebuilt, {cov.dropped} rows left, "
          f"{cov.grew_with_spare} column growths with spare rows; {stats['hits']} prefix hits")
