"""Tests for r3.py: record -> replay equivalence, live-router gradients over recorded ids, recompute."""
import base64
import os
import sys

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import mechanisms  # noqa: E402
import model as model_lib  # noqa: E402
import r3  # noqa: E402
from chat_tokens import ASSISTANT_PREFIX  # noqa: E402
from engine.server import EngineServer  # noqa: E402

torch.set_num_threads(2)
B, T = 2, 24


@pytest.fixture(scope="module")
def actor():
    m = model_lib.build_actor(model_lib.tiny_config(300), seed=0)
    return m.eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 300, (B, T), generator=torch.Generator().manual_seed(1))  # (B, T)


def capture_router_indices(m, logits=None):
    """Forward hooks that collect each router's chosen ids (N, k) (and logits (N, E)) in layer order."""
    got, hooks = {}, []
    logits = {} if logits is None else logits
    for l, r in enumerate(r3.routers(m)):
        def hook(mod, inp, out, l=l):
            got[l], logits[l] = out[2].clone(), out[0].detach().clone()
        hooks.append(r.register_forward_hook(hook))
    return got, hooks


def bottom_k_experts(m, ids):
    """(B, T, L, k): per position and layer, the k experts the live router likes LEAST."""
    logits = {}
    hooks = [r.register_forward_hook(lambda mod, inp, out, l=l: logits.__setitem__(l, out[0].detach()))
             for l, r in enumerate(r3.routers(m))]
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    k = m.config.num_experts_per_tok
    low = [logits[l].argsort(dim=-1)[:, :k] for l in range(len(logits))]  # each (N, k)
    return torch.stack(low, dim=1).reshape(ids.shape[0], ids.shape[1], len(logits), k).to(torch.int32)


def test_install_keeps_the_router_parameter_and_state_dict_keys():
    m = transformers.Qwen3_5MoeForCausalLM(model_lib.tiny_config(300))
    keys = list(m.state_dict().keys())
    weight = m.model.layers[0].mlp.gate.weight
    r3.install(m)
    r3.install(m)  # idempotent
    assert list(m.state_dict().keys()) == keys
    assert m.model.layers[0].mlp.gate.weight is weight
    assert len(r3.routers(m)) == 4 and all(isinstance(r, r3.R3Router) for r in r3.routers(m))


def test_record_has_one_row_per_position_and_layer(actor, ids):
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        actor(ids)
    ex = rec.experts
    assert ex.shape == (B, T, 4, 2) and ex.dtype == torch.int32
    assert int(ex.min()) >= 0 and int(ex.max()) < 8
    assert (ex[..., 0] != ex[..., 1]).all()  # top-k ids are distinct


def test_replayed_experts_equal_recorded_experts_in_every_layer(actor, ids):
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        actor(ids)
    recorded = rec.experts  # (B, T, L, k)
    # a different set of weights: the live router would now choose differently
    other = model_lib.build_actor(model_lib.tiny_config(300), seed=1).eval()
    got, hooks = capture_router_indices(other)
    with torch.no_grad(), r3.routing(other, "replay", recorded):
        other(ids)
    for h in hooks:
        h.remove()
    live, hooks = capture_router_indices(other)
    with torch.no_grad():
        other(ids)
    for h in hooks:
        h.remove()
    for l in range(4):
        assert torch.equal(got[l].reshape(B, T, 2).to(torch.int32), recorded[:, :, l])
    differs = sum(not torch.equal(live[l].reshape(B, T, 2).to(torch.int32), recorded[:, :, l]) for l in range(4))
    assert differs > 0  # the replay really overrode the live choice


def test_replay_with_identical_weights_gives_identical_logits(actor, ids):
    with torch.no_grad():
        off = actor(ids).logits
        with r3.routing(actor, "record") as rec:
            recorded_logits = actor(ids).logits
        with r3.routing(actor, "replay", rec.experts):
            replay_logits = actor(ids).logits
    assert torch.equal(off, recorded_logits)
    assert torch.allclose(off, replay_logits, atol=1e-6, rtol=0)


def test_gradient_reaches_router_rows_of_recorded_experts_the_live_router_would_not_choose(actor, ids):
    forced = bottom_k_experts(actor, ids)  # (B, T, L, k), never the live top-k
    forced[:, :, 0] = torch.tensor([6, 7], dtype=torch.int32)  # layer 0: one fixed pair everywhere
    actor.zero_grad()
    with r3.routing(actor, "replay", forced):
        logits = actor(ids).logits
        torch.nn.functional.log_softmax(logits, -1)[..., 5].sum().backward()
    with torch.no_grad():
        off = actor(ids).logits
    assert not torch.allclose(off, logits.detach(), atol=1e-4)  # routing was really forced
    g0 = r3.routers(actor)[0].weight.grad  # (E, H)
    assert g0[6].abs().sum() > 1e-6 and g0[7].abs().sum() > 1e-6
    # w = exp(z_i) / sum_k exp(z_k) over the recorded k: rows never recorded get no gradient (up to fp noise)
    assert g0[:6].abs().max() < 1e-4 * g0[6:].abs().max()
    for l in range(1, 4):
        g = r3.routers(actor)[l].weight.grad
        used = torch.unique(forced[:, :, l].long())
        assert (g[used].abs().sum(-1) > 0).all()
    actor.zero_grad()


def test_replay_holds_under_gradient_checkpointing(ids):
    def grads(checkpointing):
        m = model_lib.build_actor(model_lib.tiny_config(300), seed=0)
        forced = bottom_k_experts(m, ids)
        if checkpointing:
            m.activation_checkpointing_enable()
        m.train()
        calls = []
        r3.routers(m)[0].register_forward_hook(lambda *a: calls.append(1))
        with r3.routing(m, "replay", forced):  # backward (and its recompute) inside the context
            loss = torch.nn.functional.cross_entropy(m(ids).logits[:, :-1].reshape(-1, 300), ids[:, 1:].reshape(-1))
            loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        return loss.detach(), grads, len(calls)
    loss_a, ga, calls_a = grads(False)
    loss_b, gb, calls_b = grads(True)
    assert (calls_a, calls_b) == (1, 2)  # the checkpointed run recomputed the router in backward
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert ga.keys() == gb.keys() and any("mlp.gate.weight" in n for n in ga)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-6, rtol=1e-4), n


def test_live_route_is_forwards_routing_in_fewer_operations(actor):
    """R3Router.live_route (the engine's): the ids forward picks and forward's weights to 1e-6 (a softmax over the k
    logits = the softmax renormalised over the k), recorded into the routing buffer; refused in replay mode and in
    record mode without a buffer (it cannot know the batch's shape)."""
    r = r3.routers(actor)[1]
    x = torch.randn(64, r.hidden_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, w_fwd, idx_fwd = r(x)
        w, idx = r.live_route(x)
        assert torch.equal(idx, idx_fwd) and (w - w_fwd).abs().max() < 1e-6
        buf = torch.full((80, len(r3.routers(actor)), r.top_k), -7, dtype=torch.int32)
        with r3.routing(actor, "record", into=buf):
            r.live_route(x)
        assert torch.equal(buf[:64, 1], idx.int()) and (buf[:64, 0] == -7).all() and (buf[64:] == -7).all()
        with r3.routing(actor, "record"):
            with pytest.raises(ValueError, match="live_route"):
                r.live_route(x)


def test_wrong_shape_or_malformed_experts_raise(actor, ids):
    good = torch.zeros(B, T, 4, 2, dtype=torch.int32)
    good[..., 1] = 1
    with pytest.raises(ValueError, match=r"expected shape \(B, T, 4, 2\).*got \(2, 24, 3, 2\)"):
        with r3.routing(actor, "replay", good[:, :, :3]):
            pass
    with pytest.raises(ValueError, match="token rows"):
        with torch.no_grad(), r3.routing(actor, "replay", good[:, :10]):
            actor(ids)
    bad = good.clone()
    bad[0, 0, 0, 0] = 8
    with pytest.raises(ValueError, match=r"ids must be in \[0, 8\)"):
        with r3.routing(actor, "replay", bad):
            pass
    mixed = good.clone()
    mixed[0, 0, 0, 0] = -1
    with pytest.raises(ValueError, match="mixes -1"):
        with r3.routing(actor, "replay", mixed):
            pass
    with pytest.raises(ValueError, match="mode"):
        with r3.routing(actor, "replya"):
            pass
    with pytest.raises(ValueError, match="experts"):
        with r3.routing(actor, "replay"):
            pass
    # the routers are back to "off" after every failure
    assert all(r.mode == "off" for r in r3.routers(actor))


def test_minus_one_rows_fall_back_to_live_routing(actor, ids):
    forced = bottom_k_experts(actor, ids)
    forced[0, 5:] = -1  # placeholders for the tail of row 0, every layer
    logits = {}
    got, hooks = capture_router_indices(actor, logits)
    with torch.no_grad(), r3.routing(actor, "replay", forced):
        actor(ids)
    for h in hooks:
        h.remove()
    for l in range(4):
        chosen = got[l].reshape(B, T, 2).to(torch.int32)
        live = logits[l].topk(2, dim=-1).indices.reshape(B, T, 2).to(torch.int32)  # live top-k, same forward
        assert torch.equal(chosen[0, 5:].sort(-1).values, live[0, 5:].sort(-1).values)
        assert torch.equal(chosen[0, :5], forced[0, :5, l]) and torch.equal(chosen[1], forced[1, :, l])
    with torch.no_grad():
        with r3.routing(actor, "replay", torch.full((B, T, 4, 2), -1)):
            all_placeholder = actor(ids).logits
        assert torch.allclose(all_placeholder, actor(ids).logits, atol=1e-6, rtol=0)


def test_cached_forwards_are_recorded_separately_and_match_one_full_forward(actor, ids):
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        cache = DynamicCache(config=actor.config)
        actor(ids[:, :20], cache=cache, use_cache=True)
        for t in range(20, T):
            actor(ids[:, t:t + 1], cache=cache, use_cache=True)
        steps = rec.pop()
        actor(ids)
    full = rec.experts  # only the forward after pop()
    assert [s.shape[1] for s in steps] == [20, 1, 1, 1, 1]
    assert torch.equal(torch.cat(steps, dim=1), full)


def test_routed_experts_wire_format_round_trip():
    arr = np.random.default_rng(0).integers(-1, 256, size=(37, 48, 8)).astype(np.int32)
    b64 = r3.encode_routed_experts(arr)
    assert len(base64.b64decode(b64)) == 37 * 48 * 8 * 4  # 1.5 KiB per position at 48 x 8 int32
    out = r3.decode_routed_experts(b64, 48, 8)
    assert out.dtype == np.int32 and np.array_equal(out, arr)
    assert base64.b64decode(r3.encode_routed_experts(np.array([[[1, 258]]]))) == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    assert r3.decode_routed_experts("", 4, 2).shape == (0, 4, 2)
    with pytest.raises(ValueError, match="multiple of"):
        r3.decode_routed_experts(base64.b64encode(b"\x00" * 12).decode(), 4, 2)
    with pytest.raises(ValueError, match="base64"):
        r3.decode_routed_experts("not base64!", 4, 2)
    with pytest.raises(ValueError, match=r"\(N, L, k\)"):
        r3.encode_routed_experts(np.zeros((3, 4), np.int32))


def test_check_capture_allows_placeholders_only_where_the_next_token_is_not_trained():
    experts = np.zeros((6, 4, 2), np.int32)
    mask = np.array([0, 0, 0, 1, 1, 0])  # prompt, then two sampled tokens, then glue
    experts[[0, 4, 5]] = -1  # rows 0 (predicts prompt token), 4 (predicts glue), 5 (last) are free
    assert r3.check_capture(experts, mask) == 3  # placeholder rows, counted for r3_placeholder_frac
    assert r3.check_capture(experts[:5], mask) == 2  # tito's (T-1, L, k) layout: the last row omitted
    experts[2] = -1  # row 2 predicts token 3, which is trained on
    with pytest.raises(ValueError, match=r"row 2 but m\[3\] = 1"):
        r3.check_capture(experts, mask)
    with pytest.raises(ValueError, match="missing.*--enable-return-routed-experts"):
        r3.check_capture(None, mask)
    with pytest.raises(ValueError, match="T = len"):
        r3.check_capture(experts[:4], mask)


# --- R3 figures, fp32 engine equivalence, Megatron slicing ------------------------------------------
def test_mismatch_counts_only_rows_that_feed_trained_tokens(actor, ids):
    am = torch.ones(B, T, dtype=torch.long)
    m = torch.zeros(B, T)
    m[:, 12:] = 1  # rows 11..T-2 feed trained tokens
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        actor(ids)
    recorded = rec.experts
    assert r3.mismatch(actor, ids, am, recorded, m) == 0.0
    a = recorded[..., :1]  # (B, T, L, 1)
    other = torch.cat([(a + 1) % 8, (a + 2) % 8], dim=-1)  # never contains a: a different set everywhere
    wrong = recorded.clone()
    wrong[:, :11] = other[:, :11]  # rows whose next token is not trained: not counted
    assert r3.mismatch(actor, ids, am, wrong, m) == 0.0
    wrong[0, 11, 0] = other[0, 11, 0]
    assert r3.mismatch(actor, ids, am, wrong, m) == pytest.approx(1 / (2 * 12 * 4))  # 1 of 2 x 12 rows x 4 layers
    reordered = recorded.flip(-1)  # the same SET in another order is not a mismatch
    assert r3.mismatch(actor, ids, am, reordered, m) == 0.0


@pytest.fixture(scope="module")
def fp32_engine(tmp_path_factory):
    tok = model_lib.train_tokenizer([f"echo line {i} > f{i}.txt && wc -l f{i}.txt" for i in range(40)], 300)
    path = str(tmp_path_factory.mktemp("r3_engine"))
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=3), tok, path)
    engine = EngineServer(path, max_batch=4, weight_dtype="fp32").start()
    yield engine, tok, path
    engine.stop()


def test_replay_with_fp32_engine_weights_matches_rollout_logprobs(fp32_engine):
    engine, tok, path = fp32_engine
    prompts = [model_lib.render_ids(tok, "user", "echo line 3") + tok.encode(ASSISTANT_PREFIX),
               model_lib.render_ids(tok, "user", "wc -l f12.txt && echo line 7 > f7.txt")]
    bodies = [{"input_ids": p, "return_logprob": True, "return_routed_experts": True,
               "sampling_params": {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "seed": i}}
              for i, p in enumerate(prompts)]
    outs, _ = mechanisms._generate_wave(engine, bodies)  # admitted together: left-padded batched prefill + decode
    trainer, _ = model_lib.load_actor(path)
    trainer.eval()
    for p, o in zip(prompts, outs):
        seq = torch.tensor([p + o["output_ids"]])  # (1, n)
        ex = torch.from_numpy(r3.decode_routed_experts(o["meta_info"]["routed_experts"], 4, 2))  # (n-1, L, k)
        assert ex.shape[0] == seq.shape[1] - 1
        ex = torch.cat([ex, torch.full((1, 4, 2), -1, dtype=torch.int32)])[None]  # (1, n, L, k)
        with torch.no_grad(), r3.routing(trainer, "replay", ex):
            logits = trainer(seq).logits[0, len(p) - 1:-1]  # rows predicting the sampled tokens
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o["output_ids"])[:, None]).squeeze(-1)
        rollout = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(lp, rollout, atol=1e-4, rtol=0), (lp - rollout).abs().max()


def test_capture_off_samples_the_same_tokens_and_returns_no_routing(fp32_engine):
    engine, tok, _ = fp32_engine
    body = {"input_ids": model_lib.render_ids(tok, "user", "echo line 5"), "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 11}}
    (on,), _t = mechanisms._generate_wave(engine, [dict(body, return_routed_experts=True)])
    (off,), _t = mechanisms._generate_wave(engine, [dict(body, return_routed_experts=False)])
    assert on["output_ids"] == off["output_ids"]
    assert on["meta_info"]["output_token_logprobs"] == off["meta_info"]["output_token_logprobs"]
    assert "routed_experts" in on["meta_info"] and "routed_experts" not in off["meta_info"]


def _owned_rows(B_, T_, tp_rank, tp_size, sp, cp_rank, cp_size, contiguous=False):
    """Reference: (b, t) pairs in the order Megatron's router on this rank sees them (plain loops); contiguous:
    CP rank r holds the r-th of cp_size chunks (mcore._gpt_forward) instead of Megatron's zig-zag pair."""
    c = T_ // (2 * cp_size) if cp_size > 1 else T_
    ts = list(range(T_)) if cp_size == 1 else \
        list(range(cp_rank * c, (cp_rank + 1) * c)) + \
        list(range((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c))
    if cp_size > 1 and contiguous:
        ts = list(range(cp_rank * 2 * c, (cp_rank + 1) * 2 * c))
    if sp and tp_size > 1:
        n = len(ts) // tp_size
        ts = ts[tp_rank * n:(tp_rank + 1) * n]
    return [(b, t) for t in ts for b in range(B_)]  # sequence-major: row = s * B + b


@pytest.mark.parametrize("tp_size,sp,cp_size,layers,contiguous", [
    (1, False, 1, None, False), (2, True, 1, None, False), (2, False, 1, None, False), (1, False, 2, None, False),
    (2, True, 2, (2, 4), False), (4, True, 2, (0, 2), False), (1, False, 2, None, True), (2, True, 4, (2, 4), True)])
def test_slice_for_megatron_matches_the_token_layout_of_each_rank(tp_size, sp, cp_size, layers, contiguous):
    B_, T_, k = 2, 16, 2
    moe_layers = [1, 0, 1, 1]  # decoder layer 1 is dense: recorded columns are MoE layers 0, 2, 3
    b, t, l = torch.meshgrid(torch.arange(B_), torch.arange(T_), torch.arange(3), indexing="ij")
    code = (b * 1000 + t * 10 + l)[..., None].expand(B_, T_, 3, k).to(torch.int32)  # (B, T, L, k)
    first, last = layers or (0, 4)
    cols = [sum(moe_layers[:i]) for i in range(first, last) if moe_layers[i]]
    covered = []
    for cp_rank in range(cp_size):
        for tp_rank in range(tp_size):
            got = r3.slice_for_megatron(code, tp_rank=tp_rank, tp_size=tp_size, sp=sp, cp_rank=cp_rank,
                                        cp_size=cp_size, layers=layers, moe_layers=moe_layers, cp_contiguous=contiguous)
            rows = _owned_rows(B_, T_, tp_rank, tp_size, sp, cp_rank, cp_size, contiguous)
            assert len(got) == len(cols)
            for g, c in zip(got, cols):
                want = torch.tensor([[bb * 1000 + tt * 10 + c] * k for bb, tt in rows])
                assert g.dtype == torch.int64 and torch.equal(g, want)
            covered += rows
    per_rank = 1 if (sp or tp_size == 1) else tp_size  # without SP every TP rank routes all local tokens
    assert sorted(covered) == sorted([(bb, tt) for bb in range(B_) for tt in range(T_)] * per_rank)


def test_slice_for_megatron_rejects_bad_layouts():
    ex = torch.zeros(1, 6, 2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="2 \\* cp_size"):
        r3.slice_for_megatron(ex, cp_size=2)
    with pytest.raises(ValueError, match="MoE layers"):
        r3.slice_for_megatron(ex, moe_layers=[1, 1, 1])
    with pytest.raises(ValueError, match="tp_size"):
        r3.slice_for_megatron(ex[:, :5], tp_size=2, sp=True)


# --- the trainer never falls back quietly (train_t1: samples, batches, the step's figures) -----------------
def _trial(actor, name="task-a", turns=2, seed=0):
    """A token-first trial whose records carry the routing an engine would capture: (n_in + n_out - 1, L, k)."""
    L, k = len(r3.routers(actor)), actor.config.num_experts_per_tok
    g = np.random.default_rng(seed)
    prompt, recs = [5, 6, 7, 8], []
    for i in range(turns):
        out = [int(x) for x in g.integers(10, 300, 3)]
        recs.append({"prompt_ids": list(prompt), "output_ids": out, "output_logprobs": [-0.5] * len(out),
                     "routed_experts": g.integers(0, actor.config.num_experts,
                                                  (len(prompt) + 2, L, k)).astype(np.int32),
                     "finish_reason": "stop", "weight_version": 0})
        prompt = prompt + out + [11, 12]
    return {"task": name, "reward": 0.1, "passed": 2, "total": 4, "reward_source": "ctrf", "records": recs}


def test_replay_refuses_a_trial_with_one_turn_capture_missing(actor, tmp_path):
    import rollout
    import tito
    trial = _trial(actor)
    trial["records"][1]["routed_experts"] = None  # this turn's engine ran without capture
    with pytest.raises(tito.CaptureError, match=r"trial 'task-a' turn 1.*--enable-return-routed-experts"):
        rollout.to_samples([trial], tmp_path, "step1", replay=True)
    assert not (tmp_path / "failed_trials.jsonl").exists()  # never silently dropped
    (s,) = rollout.to_samples([trial], tmp_path, "step1")  # R3 off: the trial trains, without routing
    assert s["routed_experts"] is None


def test_replay_refuses_a_placeholder_row_that_feeds_a_trained_token(actor, tmp_path):
    import rollout
    trial = _trial(actor)
    n0 = len(trial["records"][0]["prompt_ids"])
    trial["records"][0]["routed_experts"][n0 - 1] = -1  # the row that predicts the first sampled token
    with pytest.raises(ValueError, match=r"trial 'task-a'.*placeholder routing at row 3 but m\[4\] = 1"):
        rollout.to_samples([trial], tmp_path, "step1", replay=True)
    trial = _trial(actor)
    trial["records"][0]["routed_experts"][0] = -1  # row 0 predicts a prompt token: allowed, counted
    (s,) = rollout.to_samples([trial], tmp_path, "step1", replay=True)
    assert s["placeholder_rows"] == 1
    assert rollout.audit_samples([s], 1)["r3_placeholder_frac"] == 1 / (len(s["tokens"]) - 1)


def test_replay_refuses_a_batch_or_sample_without_routing(actor, tmp_path):
    import rollout
    import ppo
    with_routing = rollout.to_samples([_trial(actor, "task-a")], tmp_path, "s", replay=True)
    without = rollout.to_samples([_trial(actor, "task-b", seed=1)], tmp_path, "s")
    without[0]["routed_experts"] = None
    batch = ppo.pad_batch(without, 20.0)
    with pytest.raises(ValueError, match=r"R3 replay: the batch carries no routing.*--enable-return-routed-experts"):
        ppo.forward_logprobs(actor, batch, "replay", 1.0)  # before: live routing, silently
    with pytest.raises(ValueError, match=r"1 of 2 samples carry no routing \(trials \['task-b'\]\).*"
                                         r"--enable-return-routed-experts"):
        ppo.pad_batch(with_routing + without, 20.0, replay=True)  # before: -1 rows, replayed live
    lp = ppo.forward_logprobs(actor, ppo.pad_batch(with_routing, 20.0, replay=True), "replay", 1.0)
    assert lp.shape == (1, len(with_routing[0]["tokens"]))
    assert ppo.forward_logprobs(actor, batch, "off", 1.0).shape == (1, len(without[0]["tokens"]))  # R3 off


def test_step_audit_aborts_on_a_drifted_loss_region_token(actor, tmp_path):
    import rollout
    samples = rollout.to_samples([_trial(actor)], tmp_path, "s", replay=True)
    figs = rollout.audit_samples(samples, 3)
    assert figs == {"tito_drift_pct": 0.0, "tito_relocation_failures": 0, "r3_placeholder_frac": 0.0}
    j = int(np.flatnonzero(samples[0]["loss_mask"])[0])
    samples[0]["tokens"][j] += 1
    with pytest.raises(RuntimeError, match=rf"step 3: TITO audit: 1 of 6 loss-region tokens.*'position': {j}"):
        rollout.audit_samples(samples, 3)
