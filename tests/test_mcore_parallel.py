"""The Megatron actor's training-step interface under model parallel (mcore.MegatronActor at TP = 2 with sequence
parallel, EP = 2, over spawned gloo ranks) against one rank: vocab-parallel logprobs, the R3 recording gathered
back to (B, T, L, k), and replay of a recording, with a sequence length T that is not a multiple of TP (padded);
context parallel (CP = 2: contiguous chunks, K / V all-gathered, GDN state passed) also against the one-rank
parameter gradients and critic values."""

import pytest
import torch

pytest.importorskip("megatron.core")
import gloo_pool  # noqa: E402
from cluster import mcore  # noqa: E402
from cluster import mcore_cpu  # noqa: E402
from cluster import mcore_weights  # noqa: E402
import r3  # noqa: E402
from test_mcore_tp import hf_weights  # noqa: E402

pytestmark = pytest.mark.ranks  # on tests/gloo_pool.py's kept ranks: one unit with the others (tests/suite_order.py)

B, T, V = 2, 11, 96  # T odd: sequence parallel pads it to a multiple of tp


def batch():
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(3))  # (B, T)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 8:] = 0  # right padding
    return ids, am


def actor_checks(tp=1, ep=1, pp=1, replay=None):
    """-> (logprobs via token_logprobs (B, T-1), logprobs from gathered logits, recorded experts (B, T, L, k),
    logprobs replaying `replay` (or the recording), this rank's parameter grads of the replayed logprobs' sum
    {name: grad}, critic values (B, T) of MegatronCritic.from_actor with a fixed random head)."""
    hf = mcore.tiny_qwen35_hf_config(V)
    gpt = mcore.build_tiny(hf, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                           pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    actor = mcore.MegatronActor(mcore_weights.load_hf_into_megatron(gpt, hf_weights(), hf))
    ids, am = batch()
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        lp = actor.token_logprobs(ids, am)  # (B, T-1)
        recorded = rec.experts  # (B, T, L, k)
    with torch.no_grad():
        full = torch.log_softmax(actor(input_ids=ids, attention_mask=am).logits[:, :-1], -1)
        lp_full = full.gather(-1, ids[:, 1:, None]).squeeze(-1)
    experts = recorded if replay is None else torch.as_tensor(replay)
    with r3.routing(actor, "replay", experts) as ctx:
        lp_replay = actor.token_logprobs(ids, am)
        ctx.backward_mode()
        (lp_replay * am[:, 1:]).sum().backward()
    grads = {k: p.grad.clone() for k, p in actor.gpt.named_parameters() if p.grad is not None}
    critic = mcore.MegatronCritic.from_actor(actor)
    with torch.no_grad():
        if critic.gpt.post_process:  # last pipeline stage: the head
            head = critic.gpt.output_layer
            head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5)))
        values = critic(ids, am)  # (B, T)
    return lp, lp_full, recorded, lp_replay.detach(), grads, values


PLANS = [(1, 2, 2, 1), (2, 1, 1, 2), (1, 1, 1, 2)]  # (tp, ep, pp, cp)


def _rank(rank, world, replay):
    """One spawn of 4 ranks for every plan: Megatron's parallel state rebuilt per plan (a plan of 2 ranks runs on
    ranks 0 and 1, the others only join the group creation), then the Qwen3-MoE CP = 2 run on ranks 0 and 1."""
    from megatron.core import parallel_state
    mcore_cpu.init_cpu()
    res = {}
    for tp, ep, pp, cp in PLANS:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 pipeline_model_parallel_size=pp, context_parallel_size=cp)
        if rank < tp * ep * pp * cp:
            *out, grads, values = actor_checks(tp, ep, pp, replay)
            res[tp, ep, pp, cp] = [x.numpy() for x in out] + [{k: g.numpy() for k, g in grads.items()},
                                                              values.numpy()]
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    if rank < 2:
        lp, grads = qwen3_moe_checks()
        res["qwen3"] = lp.numpy(), {k: g.numpy() for k, g in grads.items()}
    return res


@pytest.fixture(scope="module")
def reference():
    mcore_cpu.init_cpu()
    return actor_checks()


@pytest.fixture(scope="module")
def shifted(reference):
    return (reference[2] + 1) % 8  # a routing the live routers would not choose


@pytest.fixture(scope="module")
def one_rank_replay(shifted):
    """One rank replaying the shifted routing: actor_checks(replay=shifted), once for every plan."""
    mcore_cpu.init_cpu()
    return actor_checks(replay=shifted)


@pytest.fixture(scope="module")
def ranks(shifted):
    """Every plan's and the Qwen3-MoE run's results from one spawn of 4 gloo ranks: {plan or "qwen3": [per rank]}."""
    res = gloo_pool.ranks(_rank, 4, shifted.numpy(), timeout_s=480)
    return {key: [r[key] for r in res if key in r] for key in PLANS + ["qwen3"]}


# TP alone is covered by TP x CP, EP and PP alone by EP x PP (4 ranks); CP alone keeps the summed-grads check
@pytest.mark.parametrize("tp,ep,pp,cp", [(1, 2, 2, 1), (1, 1, 1, 2), (2, 1, 1, 2)])
def test_parallel_actor_logprobs_and_r3_match_one_rank(reference, one_rank_replay, ranks, tp, ep, pp, cp):
    """Every rank: token_logprobs from the vocab shards = one-rank logprobs; the recording gathered over the
    sequence-parallel (and context-parallel) ranks = the one-rank recording (same routing); replaying a perturbed
    routing (every expert id shifted by one) gives the one-rank replay of that routing on every rank. CP = 2: the
    critic's values = one rank's, and (TP = 1) the parameter grads summed over the CP ranks (what DDP's reduce over
    DP x CP does) = the one-rank grads."""
    lp1, _, rec1, _, _, _ = reference
    _, _, _, want_replay, want_grads, want_values = one_rank_replay
    res = ranks[tp, ep, pp, cp]
    assert len(res) == tp * ep * pp * cp
    m = batch()[1][:, 1:].bool()
    d_lp = d_full = d_rep = 0.0
    for lp, lp_full, rec, rep in ([torch.from_numpy(x) for x in r[:4]] for r in res):
        d_lp = max(d_lp, (lp - lp1)[m].abs().max().item())
        d_full = max(d_full, (lp_full - lp1)[m].abs().max().item())
        d_rep = max(d_rep, (rep - want_replay)[m].abs().max().item())
        assert rec.shape == rec1.shape
        assert torch.equal(rec[:, :T - 1][m], rec1[:, :T - 1][m])  # trained rows route the same
    print(f"TP={tp} EP={ep} PP={pp} CP={cp}: |logprobs - one rank| {d_lp:.1e} (gathered logits {d_full:.1e}), "
          f"replay of a shifted routing {d_rep:.1e}")
    assert d_lp < 1e-5 and d_full < 1e-5 and d_rep < 1e-5
    if cp > 1:
        vm = batch()[1].bool()
        d_val = max((torch.from_numpy(r[5]) - want_values)[vm].abs().max().item() for r in res)
        print(f"TP={tp} CP={cp}: critic values {d_val:.1e} of one rank's (|V| up to {want_values.abs().max():.2f})")
        assert d_val < 1e-5
    if cp > 1 and tp * ep * pp == 1:  # every rank holds the whole model: its grads are its chunk's share
        assert all(set(r[4]) == set(want_grads) for r in res)
        grads = {k: sum(torch.from_numpy(r[4][k]) for r in res) for k in want_grads}
        scale = max(g.abs().max().item() for g in want_grads.values())
        d_grad = max((grads[k] - g).abs().max().item() for k, g in want_grads.items()) / scale
        print(f"CP={cp}: grads summed over CP ranks vs one rank {d_grad:.1e} of max |grad| {scale:.1f} "
              f"({len(want_grads)} tensors)")
        assert d_grad < 1e-5
    assert (want_replay - lp1)[m].abs().max() > 1e-3  # the shifted routing really changes the logprobs


def qwen3_moe_checks():
    """Qwen3-MoE layout (every layer standard attention, full rotary): token_logprobs (B, T-1) and this rank's
    parameter grads of their masked sum."""
    from transformers import Qwen3MoeForCausalLM
    hf = mcore.tiny_hf_config(V)
    torch.manual_seed(0)
    weights = Qwen3MoeForCausalLM(hf).state_dict()
    actor = mcore.MegatronActor(mcore_weights.load_hf_into_megatron(mcore.build_tiny(hf), weights, hf))
    ids, am = batch()
    lp = actor.token_logprobs(ids, am)  # (B, T-1)
    (lp * am[:, 1:]).sum().backward()
    return lp.detach(), {k: p.grad.clone() for k, p in actor.gpt.named_parameters() if p.grad is not None}


def test_qwen3_moe_context_parallel_matches_one_rank(ranks):
    """CP = 2 without GDN (T = 11 -> 12, chunks of 6): every layer's attention reads the other chunk's K / V and
    the rotary positions of the second chunk start at 6; logprobs and grads summed over the CP ranks = one rank."""
    mcore_cpu.init_cpu()
    lp1, g1 = qwen3_moe_checks()
    res = ranks["qwen3"]
    assert len(res) == 2
    m = batch()[1][:, 1:].bool()
    d_lp = max((torch.from_numpy(lp) - lp1)[m].abs().max().item() for lp, _ in res)
    scale = max(g.abs().max().item() for g in g1.values())
    d_grad = max((sum(torch.from_numpy(r[1][k]) for r in res) - g).abs().max().item() for k, g in g1.items()) / scale
    print(f"Qwen3-MoE CP=2: logprobs {d_lp:.1e}, grads summed over CP ranks {d_grad:.1e} of max |grad| {scale:.1f}")
    assert d_lp < 1e-5 and d_grad < 1e-5
