"""The Megatron actor's training-step interface under model parallel (mcore.MegatronActor at TP = 2 with sequence
parallel, EP = 2, over spawned gloo ranks) against one rank: vocab-parallel logprobs, the R3 recording gathered
back to (B, T, L, k), and replay of a recording, with a sequence length T that is not a multiple of TP (padded)."""

import pytest
import torch

pytest.importorskip("megatron.core")
import infra  # noqa: E402
import mcore  # noqa: E402
import r3  # noqa: E402
from test_mcore_tp import hf_weights  # noqa: E402

B, T, V = 2, 11, 96  # T odd: sequence parallel pads it to a multiple of tp


def batch():
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(3))  # (B, T)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 8:] = 0  # right padding
    return ids, am


def actor_checks(tp=1, ep=1, pp=1, replay=None):
    """-> (logprobs via token_logprobs (B, T-1), logprobs from gathered logits, recorded experts (B, T, L, k),
    logprobs replaying `replay` (or the recording) with their grad norm over this rank's shard)."""
    hf = mcore.tiny_qwen35_hf_config(V)
    gpt = mcore.build_tiny(hf, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                           pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    actor = mcore.MegatronActor(mcore.load_hf_into_megatron(gpt, hf_weights(), hf))
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
    return lp, lp_full, recorded, lp_replay.detach()


def _rank(rank, world, tp, ep, pp, replay):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             pipeline_model_parallel_size=pp)
    mcore.init_cpu()
    return [x.numpy() for x in actor_checks(tp, ep, pp, replay)]


@pytest.fixture(scope="module")
def reference():
    mcore.init_cpu()
    return actor_checks()


@pytest.mark.parametrize("tp,ep,pp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_parallel_actor_logprobs_and_r3_match_one_rank(reference, tp, ep, pp):
    """Every rank: token_logprobs from the vocab shards = one-rank logprobs; the recording gathered over the
    sequence-parallel ranks = the one-rank recording (same routing); replaying a perturbed routing (every
    expert id shifted by one) gives the one-rank replay of that routing on every rank."""
    lp1, _, rec1, _ = reference
    shifted = (rec1 + 1) % 8  # a routing the live routers would not choose
    mcore.init_cpu()
    _, _, _, want_replay = actor_checks(replay=shifted)
    res = infra.gloo_ranks(_rank, tp * ep * pp, tp, ep, pp, shifted.numpy(), timeout_s=240)
    m = batch()[1][:, 1:].bool()
    d_lp = d_full = d_rep = 0.0
    for lp, lp_full, rec, rep in ([torch.from_numpy(x) for x in r] for r in res):
        d_lp = max(d_lp, (lp - lp1)[m].abs().max().item())
        d_full = max(d_full, (lp_full - lp1)[m].abs().max().item())
        d_rep = max(d_rep, (rep - want_replay)[m].abs().max().item())
        assert rec.shape == rec1.shape
        assert torch.equal(rec[:, :T - 1][m], rec1[:, :T - 1][m])  # trained rows route the same
    print(f"TP={tp} EP={ep} PP={pp}: |logprobs - one rank| {d_lp:.1e} (gathered logits {d_full:.1e}), "
          f"replay of a shifted routing {d_rep:.1e}")
    assert d_lp < 1e-5 and d_full < 1e-5 and d_rep < 1e-5
    assert (want_replay - lp1)[m].abs().max() > 1e-3  # the shifted routing really changes the logprobs
