"""Model-parallel tiny Qwen3.5 GPTModel (mcore_convert.shard_for_tp / shard_for_ep): the same HF weights loaded into
Megatron-Core's GPTModel sharded over 2 spawned gloo processes (TP = 2 with sequence parallel, or EP = 2) vs the
TP = EP = 1 model in this process: full-vocab logits gathered on every rank and the parameter grads must match.
The way back (mcore_convert.unshard_tp / unshard_ep, mcore_weights.gather_full_state, to_hf / save_hf): shard ->
unshard is the identity, and a model loaded sharded over 2 or 4 ranks gathers and converts back to the HF weights bit
for bit."""

import pytest
import torch

pytest.importorskip("megatron.core")
import gloo_pool  # noqa: E402
from cluster import mcore  # noqa: E402
from cluster import mcore_convert  # noqa: E402
from cluster import mcore_cpu  # noqa: E402
from cluster import mcore_weights  # noqa: E402

pytestmark = pytest.mark.ranks  # on tests/gloo_pool.py's kept ranks: one unit with the others (tests/suite_order.py)

B, T, V = 2, 12, 96


def hf_weights():
    """Tiny Qwen3.5-MoE HF state dict, norms / gates / dt_bias moved off their init (every sharding rule matters)."""
    from transformers import Qwen3_5MoeForCausalLM
    torch.manual_seed(0)
    m = Qwen3_5MoeForCausalLM(mcore.tiny_qwen35_hf_config(V))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "gate" in name or "dt_bias" in name or "A_log" in name:
                p.add_(0.1 * torch.randn(p.shape))
    return m.state_dict()


def batch():
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))  # (B, T)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 9:] = 0  # right padding
    return ids, am


def run_model(tp=1, ep=1, etp=None):
    """This rank's model on batch(): forward, gather the vocab shards (Megatron's all-gather; its backward takes
    this rank's slice), backward of sum(logits * dout) -> (full-vocab logits (B, T, V), {param name: grad},
    names of the parameters flagged `sequence_parallel`, whose grads Megatron's finalize_model_grads all-reduces
    over TP). etp: expert tensor parallel size (None: = tp)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    hf = mcore.tiny_qwen35_hf_config(V)
    gpt = mcore.build_tiny(hf, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                           expert_tensor_parallel_size=etp)
    gpt = mcore_weights.load_hf_into_megatron(gpt, hf_weights(), hf)  # train mode: MoELayer refuses TP > 1 without SP
    with mcore_cpu.cpu_shims():  # the gather allocates on torch.cuda.current_device()
        out = mcore._gpt_forward(gpt, *batch())  # (B, T, V / tp): the vocab-parallel output layer's shard
        out = gather_from_tensor_model_parallel_region(out) if tp > 1 else out  # (B, T, V)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))  # (B, T, V)
        (out * dout).sum().backward()
    params = dict(gpt.named_parameters())
    return out.detach(), {n: p.grad for n, p in params.items()}, {n for n, p in params.items()
                                                                    if getattr(p, "sequence_parallel", False)}


PARALLEL_PLANS = [(2, 1, None), (1, 2, None), (2, 2, 1)]  # (tp, ep, etp) on 2 ranks each


def _parallel_rank(rank, world):
    """Every plan of PARALLEL_PLANS on the same 2 ranks, Megatron's parallel state rebuilt for each."""
    from megatron.core import parallel_state
    mcore_cpu.init_cpu()  # shims only: the group and parallel state below are kept
    res = {}
    for tp, ep, etp in PARALLEL_PLANS:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp)
        out, grads, sp = run_model(tp, ep, etp)
        res[tp, ep, etp] = out.numpy(), {n: g.numpy() for n, g in grads.items()}, sp
    return res


@pytest.fixture(scope="module")
def parallel_runs():
    """One spawn of 2 ranks -> {(tp, ep, etp): each rank's (gathered logits (B, T, V), {param name: grad},
    sequence-parallel names)}."""
    res = gloo_pool.ranks(_parallel_rank, 2, timeout_s=240)
    return {plan: [(torch.from_numpy(r[plan][0]), {n: torch.from_numpy(g) for n, g in r[plan][1].items()}, r[plan][2])
                   for r in res] for plan in PARALLEL_PLANS}


@pytest.fixture(scope="module")
def reference():
    mcore_cpu.init_cpu()
    return run_model()


def test_shard_for_tp_splits_each_part():
    """GDN in_proj [q k v z b a] and GLU fc1 [gate; up] split per part; the two shards re-join to the whole."""
    hf = mcore.tiny_qwen35_hf_config(V)
    sd = mcore_convert.hf_to_megatron(hf_weights(), hf)
    s0, s1 = (mcore_convert.shard_for_tp(sd, hf, r, 2) for r in range(2))
    k = "decoder.layers.0.self_attention.in_proj.weight"
    sizes = [16, 16, 32, 32, 4, 4]  # q k v z b a rows at TP = 1 (2 x 8, 2 x 8, 4 x 8, 4 x 8, 4, 4)
    half = [n // 2 for n in sizes]
    for whole, a, b in zip(sd[k].split(sizes), s0[k].split(half), s1[k].split(half)):
        assert torch.equal(torch.cat([a, b]), whole)
    k = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    gate, up = sd[k].chunk(2)
    assert torch.equal(s1[k], torch.cat([gate[8:], up[8:]]))
    k = "decoder.layers.3.self_attention.linear_proj.weight"
    assert torch.equal(torch.cat([s0[k], s1[k]], dim=1), sd[k])


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_parallel_model_matches_one_rank(reference, parallel_runs, tp, ep):
    """Logits equal on every rank; TP (with sequence parallel: MoELayer refuses to train TP > 1 without it): each
    rank's grads are the TP = 1 grads sharded the same way, replicated ones summed over ranks; EP: both ranks ran
    the same batch, so a local expert's grad is twice the TP = 1 one (the allgather dispatcher brings it both
    ranks' tokens) and every other grad is the TP = 1 one (before DDP)."""
    hf = mcore.tiny_qwen35_hf_config(V)
    ref_out, ref_g, _ = reference
    results = parallel_runs[tp, ep, None]
    d_out = max((out - ref_out).abs().max().item() for out, _, _ in results)
    d_g = 0.0
    for rank, (_, grads, sp) in enumerate(results):
        tp_rank, ep_rank = rank % tp, rank // tp  # parallel_state's order: TP fastest
        want = mcore_convert.shard_for_ep(mcore_convert.shard_for_tp(ref_g, hf, tp_rank, tp), hf.num_experts,
                                          ep_rank, ep)
        want = {k: 2 * g if ep > 1 and ".local_experts." in k else g for k, g in want.items()}
        if tp > 1:  # replicated parameters saw this rank's sequence slice or heads: partial sums over TP ranks,
            replicated = {k for k in want if want[k].shape == ref_g[k].shape and ".local_experts." not in k}
            assert replicated <= sp  # ... which Megatron's finalize_model_grads all-reduces (flag sequence_parallel)
            grads = {k: sum(r[1][k] for r in results) if k in replicated else g for k, g in grads.items()}
        d_g = max(d_g, max_diff(grads, want))
    scale = max(g.abs().max().item() for g in ref_g.values())
    print(f"TP={tp} EP={ep}: max |logits - TP=EP=1| {d_out:.1e} (|logits| up to {ref_out.abs().max():.2f}), "
          f"grads {d_g:.1e} (|grad| up to {scale:.1f})")
    assert d_out < 1e-5
    assert d_g < 1e-5 * scale


# --- the inverse: sharded Megatron -> TP = EP = 1 -> Hugging Face (mcore_convert.unshard_tp / unshard_ep /
# mcore_weights.gather_full_state)
def hf_config(layout):
    """"qwen35": the tiny Qwen3.5 (2 KV groups, 2 GDN key heads: TP <= 2); "qwen35_tp4": with 4 KV groups and 4 GDN
    key heads, so TP = 4 keeps whole query groups and key heads per rank; "qwen3": the tiny Qwen3-MoE."""
    if layout == "qwen3":
        return mcore.tiny_hf_config(V)
    hf = mcore.tiny_qwen35_hf_config(V)
    if layout == "qwen35_tp4":
        hf.num_key_value_heads = hf.linear_num_key_heads = 4
    return hf


def weights_of(hf):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf).state_dict()


@pytest.mark.parametrize("layout,tp,ep", [("qwen35", 2, 1), ("qwen35_tp4", 4, 1), ("qwen35", 1, 2), ("qwen35", 1, 4),
                                          ("qwen35", 2, 2), ("qwen35_tp4", 4, 2), ("qwen3", 2, 2)])
def test_unshard_inverts_shard(layout, tp, ep):
    """shard_for_ep then shard_for_tp on every (ep, tp) rank, unshard_tp over each EP rank's TP row, unshard_ep
    over the rows: the TP = EP = 1 dict back, bit for bit, same keys and dtypes."""
    hf = hf_config(layout)
    E = hf.num_experts
    sd = mcore_convert.hf_to_megatron(hf_weights() if layout == "qwen35" else weights_of(hf), hf)
    shards = [[mcore_convert.shard_for_tp(mcore_convert.shard_for_ep(sd, E, e, ep), hf, t, tp) for t in range(tp)]
              for e in range(ep)]
    k = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"  # really cut: 1 / tp rows, E / ep experts
    assert shards[-1][-1][k].shape[0] * tp == sd[k].shape[0]
    assert sum(".local_experts." in n for n in shards[-1][-1]) * ep == sum(".local_experts." in n for n in sd)
    back = mcore_convert.unshard_ep([mcore_convert.unshard_tp(row, hf, tp) for row in shards], E, ep)
    assert back.keys() == sd.keys()
    for n in sd:
        assert back[n].dtype == sd[n].dtype and torch.equal(back[n], sd[n]), n


def value_head(H):
    """A non-zero critic head (1, H), (1,): the zero init would hide a wrong gather."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, H, generator=g), torch.randn(1, generator=g)


class _Tokenizer:
    """save_hf writes the tokenizer beside the weights; this one leaves a file naming the rank that wrote."""

    def save_pretrained(self, path):
        import torch.distributed as dist
        open(f"{path}/tokenizer_by_rank{dist.get_rank()}", "w").close()


def _gather_rank(rank, world, tp, ep, path, etp=None):
    """One rank: the HF weights loaded sharded; gather_full_state -> megatron_to_hf, to_hf, a MegatronCritic's
    gather -> critic_megatron_to_hf, the gather to rank 0 alone, and save_hf to `path`."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    mcore_cpu.init_cpu()
    hf = mcore.tiny_qwen35_hf_config(V)
    gpt = mcore.build_tiny(hf, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                           expert_tensor_parallel_size=etp)
    actor = mcore.MegatronActor(mcore_weights.load_hf_into_megatron(gpt, hf_weights(), hf))
    back = mcore_convert.megatron_to_hf(mcore_weights.gather_full_state(actor.gpt, hf), hf)
    via_to_hf = mcore_weights.to_hf(actor, hf).state_dict()
    critic = mcore.MegatronCritic.from_actor(actor)
    with torch.no_grad():
        w, b = value_head(hf.hidden_size)
        critic.gpt.output_layer.weight.copy_(w)
        critic.gpt.output_layer.bias.copy_(b)
    critic_hf = mcore_convert.critic_megatron_to_hf(mcore_weights.gather_full_state(critic.gpt, hf), hf)
    to0 = mcore_weights.gather_full_state(actor.gpt, hf, to_rank0=True)  # None on every rank but 0
    to0 = None if to0 is None else mcore_convert.megatron_to_hf(to0, hf)
    mcore_weights.save_hf(actor, hf, _Tokenizer(), path)
    as_np = lambda d: None if d is None else {k: v.numpy() for k, v in d.items()}  # noqa: E731
    return as_np(back), as_np(via_to_hf), as_np(critic_hf), as_np(to0)


def one_rank_critic(hf):
    """The same critic at TP = EP = 1, converted: what every rank's gathered critic must equal."""
    mcore_cpu.init_cpu()
    actor = mcore.MegatronActor(mcore_weights.load_hf_into_megatron(mcore.build_tiny(hf), hf_weights(), hf))
    critic = mcore.MegatronCritic.from_actor(actor)
    with torch.no_grad():
        w, b = value_head(hf.hidden_size)
        critic.gpt.output_layer.weight.copy_(w)
        critic.gpt.output_layer.bias.copy_(b)
    sd = {k: v for k, v in critic.gpt.state_dict().items() if not k.endswith("_extra_state")}
    return mcore_convert.critic_megatron_to_hf(sd, hf)


def assert_bit_equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        g = torch.as_tensor(got[k])
        assert g.dtype == want[k].dtype and torch.equal(g, want[k]), k


@pytest.mark.parametrize("tp,ep", [(2, 2)])  # TP alone and EP alone: both gathers run here, on 4 ranks
def test_gather_full_state_gives_back_the_hf_checkpoint(tp, ep, tmp_path):
    """tp * ep gloo ranks (TP with sequence parallel), the HF weights loaded sharded: on every rank the gathered
    state converts back to the original HF state dict bit for bit (megatron_to_hf and to_hf), a MegatronCritic's
    gather (replicated scalar head) converts to the one-rank critic's, and save_hf leaves one checkpoint, written
    by rank 0 alone, that loads back to the same weights. The gather to rank 0 (save / publish) gives rank 0 the
    same weights and every other rank None."""
    from transformers import AutoModelForCausalLM
    hf = mcore.tiny_qwen35_hf_config(V)
    want, want_critic = hf_weights(), one_rank_critic(hf)
    results = gloo_pool.ranks(_gather_rank, tp * ep, tp, ep, str(tmp_path), timeout_s=180)
    for rank, (back, via_to_hf, critic_hf, to0) in enumerate(results):
        assert_bit_equal(back, want)
        assert_bit_equal(via_to_hf, want)
        assert_bit_equal(critic_hf, want_critic)
        assert (to0 is None) == (rank != 0), rank
    assert_bit_equal(results[0][3], want)
    assert [f for f in sorted(p.name for p in tmp_path.iterdir()) if f.startswith("tokenizer_by")] == \
        ["tokenizer_by_rank0"]
    assert_bit_equal(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict(), want)


# --- expert tensor parallel != TP (infra.py's planner: etp = 1 at tp = 2): experts cut by ETP, the rest by TP ---------
@pytest.mark.parametrize("layout,tp,etp,ep", [("qwen35", 2, 1, 1), ("qwen35", 2, 1, 2), ("qwen35", 1, 2, 1),
                                              ("qwen35", 1, 2, 2), ("qwen35_tp4", 4, 2, 2), ("qwen3", 2, 1, 2)])
def test_unshard_inverts_shard_with_expert_tp(layout, tp, etp, ep):
    """shard_for_tp with its own expert-TP rank / size (megatron-core 0.16.1 sets no bound between ETP and TP:
    only world % (etp * ep * pp) == 0 in parallel_state): expert tensors are cut 1 / etp, dense ones (the shared
    expert too) 1 / tp; unshard_tp over max(tp, etp) ranks (rank i: TP rank i % tp, ETP rank i % etp) per EP rank,
    unshard_ep over those: the TP = EP = 1 dict back, bit for bit."""
    hf = hf_config(layout)
    E, n = hf.num_experts, max(tp, etp)
    sd = mcore_convert.hf_to_megatron(hf_weights() if layout == "qwen35" else weights_of(hf), hf)
    shards = [[mcore_convert.shard_for_tp(mcore_convert.shard_for_ep(sd, E, e, ep), hf, i % tp, tp, i % etp, etp)
               for i in range(n)] for e in range(ep)]
    last = shards[-1][-1]
    k = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert last[k].shape[0] * etp == sd[k].shape[0]  # experts by ETP
    k = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    assert last[k].shape[1] * etp == sd[k].shape[1]
    k = "decoder.layers.0.self_attention.linear_qkv.weight" if layout == "qwen3" else \
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"  # dense (the shared expert: Megatron's TP group)
    assert last[k].shape[0] * tp == sd[k].shape[0]
    k = "decoder.layers.0.mlp.router.weight"
    assert torch.equal(last[k], sd[k])  # replicated
    back = mcore_convert.unshard_ep([mcore_convert.unshard_tp(row, hf, tp, etp) for row in shards], E, ep)
    assert back.keys() == sd.keys()
    for n in sd:
        assert back[n].dtype == sd[n].dtype and torch.equal(back[n], sd[n]), n


def test_expert_tp_1_under_tp_2_matches_one_rank(reference, parallel_runs):
    """2 gloo ranks, TP = 2 with sequence parallel, ETP = 1, EP = 2 (dp = 1: the experts split over the two TP
    ranks, each whole on its rank). Logits equal on both ranks. Grads: dense tensors as in the TP = 2 test (this
    rank's TP shard, replicated ones summed over the TP ranks); expert tensors whole (ETP = 1), this rank's E / 2
    experts, and exactly the TP = 1 grad: sequence parallel gives each rank half the tokens and the allgather
    dispatcher gathers them over the expert-TP x EP group (both ranks), so every token reaches its experts once
    (factor 1; the EP = 2 test has factor 2 because there both ranks ran the whole batch)."""
    hf = mcore.tiny_qwen35_hf_config(V)
    ref_out, ref_g, _ = reference
    tp, etp, ep = 2, 1, 2
    results = parallel_runs[tp, ep, etp]
    d_out = max((out - ref_out).abs().max().item() for out, _, _ in results)
    d_dense = d_experts = 0.0
    for rank, (_, grads, sp) in enumerate(results):
        tp_rank, ep_rank = rank % tp, rank // etp % ep  # dense: TP fastest; experts: ETP fastest, then EP
        want = mcore_convert.shard_for_ep(mcore_convert.shard_for_tp(ref_g, hf, tp_rank, tp, 0, etp), hf.num_experts,
                                          ep_rank, ep)
        replicated = {k for k in want if want[k].shape == ref_g[k].shape and ".local_experts." not in k}
        assert replicated <= sp  # summed over TP by finalize_model_grads (flag sequence_parallel)
        grads = {k: sum(r[1][k] for r in results) if k in replicated else g for k, g in grads.items()}
        assert grads.keys() == want.keys()
        for k in want:
            d = (grads[k] - want[k]).abs().max().item()
            if ".local_experts." in k:
                assert grads[k].shape == ref_g[k].shape  # whole experts at ETP = 1
                d_experts = max(d_experts, d)
            else:
                d_dense = max(d_dense, d)
    scale = max(g.abs().max().item() for g in ref_g.values())
    print(f"TP={tp} ETP={etp} EP={ep}: max |logits - TP=EP=1| {d_out:.1e} (|logits| up to {ref_out.abs().max():.2f}), "
          f"grads dense {d_dense:.1e}, experts {d_experts:.1e} (|grad| up to {scale:.1f})")
    assert d_out < 1e-5
    assert max(d_dense, d_experts) < 1e-5 * scale


def test_gather_full_state_with_expert_tp_1_under_tp_2(tmp_path):
    """TP = 2 (+ SP), ETP = 1, EP = 2 over 2 gloo ranks: dense tensors gathered over the TP group, experts (whole
    per rank) not over expert TP (size 1) but over EP; every rank's gathered state converts back to the HF weights
    bit for bit (megatron_to_hf and to_hf), the critic's to the one-rank critic's, and save_hf's checkpoint loads
    back to them."""
    from transformers import AutoModelForCausalLM
    hf = mcore.tiny_qwen35_hf_config(V)
    want, want_critic = hf_weights(), one_rank_critic(hf)
    results = gloo_pool.ranks(_gather_rank, 2, 2, 2, str(tmp_path), 1, timeout_s=180)
    for rank, (back, via_to_hf, critic_hf, to0) in enumerate(results):
        assert_bit_equal(back, want)
        assert_bit_equal(via_to_hf, want)
        assert_bit_equal(critic_hf, want_critic)
        assert (to0 is None) == (rank != 0), rank
    assert_bit_equal(results[0][3], want)
    assert_bit_equal(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict(), want)
