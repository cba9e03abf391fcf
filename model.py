"""The model: tiny Qwen3.5-MoE config and builders, tokenizer and chat format, checkpoints (paper: the model).

T1 trains Qwen3.5-122B-A10B, a hybrid MoE (Gated DeltaNet linear attention 3:1 with gated full attention; 48 MoE
layers, 256 experts, top-8). The embedded scale uses the same Hugging Face architecture (Qwen3_5MoeForCausalLM) at a
tiny size; engine/server.py serves its checkpoints over SGLang's protocol.

    python -m engine.server serve --model-path DIR --port 30000   # serve a checkpoint written by save_checkpoint

engine_forward is the engine's own forward (decode steps and prefills) for the Qwen3-MoE layout (as SGLang keeps its
own model code beside the Hub's): the same weights and math as the transformers forward, in fewer operations.

Departures from the paper:
1. Tiny random-init model (tiny_config) on CPU instead of Qwen3.5-122B-A10B on GPUs; same HF architecture, so R3
   and the hybrid cache are exercised for real.
2. Tokenizer: byte-level BPE trained on the task corpus (a few hundred to 2k tokens) with Qwen3.5's pre-tokenizer
   (NFC + split regex) and ChatML specials, instead of Qwen's 248k vocabulary.
"""

import json
import os

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as QWEN_PRETOKENIZE_REGEX
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

import r3
from chat_tokens import IM_END, IM_START, PAD

# --- chat format (Qwen ChatML) -----------------------------------------------------------------
SPECIAL_TOKENS = [PAD, IM_START, IM_END]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + IM_END + "' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + IM_START + "assistant\\n' }}{% endif %}"
)

# --- tiny preset: the Qwen3.5 hybrid MoE at embedded scale ---------------------------------------
TINY_HIDDEN = 128
TINY_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]  # Qwen3.5 3:1 hybrid
TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM = 4, 2, 32
TINY_LINEAR_K_HEADS, TINY_LINEAR_V_HEADS, TINY_LINEAR_HEAD_DIM = 2, 4, 32
TINY_EXPERTS, TINY_TOP_K = 8, 2  # paper: 256 experts, top-8
TINY_MOE_INTERMEDIATE, TINY_SHARED_INTERMEDIATE = 128, 128
TINY_MAX_POSITIONS = 8192


def train_tokenizer(texts: list, vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Byte-level BPE on `texts` (same texts -> same vocab); specials at ids 0, 1, 2; ChatML template.

    The pipeline is Qwen3.5's (NFC, Qwen's split regex, byte-level), returned as `Qwen3_5Tokenizer`,
    which is what `AutoTokenizer` rebuilds for a qwen3_5_moe_text checkpoint: save -> load is exact.
    """
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: expected a non-empty list of str")
    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(f"vocab_size: must be >= {min_size} (specials + 256 bytes), got {vocab_size}")
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer)
    bpe = json.loads(tk.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    tok = Qwen3_5Tokenizer(vocab=bpe["vocab"], merges=merges, unk_token=None, pad_token=PAD, eos_token=IM_END,
                           extra_special_tokens=[IM_START])
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == [0, 1, 2], f"special token ids {ids}"
    return tok


def render_ids(tok, role: str, content: str) -> list:
    """Token ids of one whole message `<|im_start|>{role}\\n{content}<|im_end|>\\n` (no BOS)."""
    if role not in ("system", "user", "assistant"):
        raise ValueError(f"role: expected system|user|assistant, got {role!r}")
    return tok.encode(f"{IM_START}{role}\n{content}{IM_END}\n", add_special_tokens=False)


ARCHS = ("qwen3_5_moe", "qwen3_moe")


def padded_vocab(n_tokens: int, multiple: int) -> int:
    """The model's vocabulary: the tokenizer's padded to a multiple (Megatron's vocab-parallel embedding splits its
    rows evenly over tp); the padded rows no token maps to, as Qwen's own."""
    return -(-n_tokens // multiple) * multiple


def tiny_config(vocab_size: int, arch: str = "qwen3_5_moe"):
    """The embedded preset (hidden 128, 4 layers [GDN x3, full], 8 experts top-2, aux loss off).

    arch "qwen3_moe": the same sizes with standard attention in every layer and no shared expert
    (Qwen3-MoE), the other layout cluster/mcore.py converts (`train_t1.py --arch qwen3_moe`).
    """
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=2 * TINY_MOE_INTERMEDIATE,
            num_hidden_layers=len(TINY_LAYER_TYPES), num_attention_heads=TINY_HEADS,
            num_key_value_heads=TINY_KV_HEADS, head_dim=TINY_HEAD_DIM, num_experts=TINY_EXPERTS,
            num_experts_per_tok=TINY_TOP_K, moe_intermediate_size=TINY_MOE_INTERMEDIATE, norm_topk_prob=True,
            router_aux_loss_coef=0.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=0, eos_token_id=2, max_position_embeddings=TINY_MAX_POSITIONS)
    if arch != "qwen3_5_moe":
        raise ValueError(f"arch: expected one of {'|'.join(ARCHS)}, got {arch!r}")
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, num_hidden_layers=len(TINY_LAYER_TYPES),
        layer_types=list(TINY_LAYER_TYPES), num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS, head_dim=TINY_HEAD_DIM,
        linear_num_key_heads=TINY_LINEAR_K_HEADS, linear_num_value_heads=TINY_LINEAR_V_HEADS,
        linear_key_head_dim=TINY_LINEAR_HEAD_DIM, linear_value_head_dim=TINY_LINEAR_HEAD_DIM,
        num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOP_K,
        moe_intermediate_size=TINY_MOE_INTERMEDIATE, shared_expert_intermediate_size=TINY_SHARED_INTERMEDIATE,
        router_aux_loss_coef=0.0,  # paper: MoE load-balancing coefficient 0
        pad_token_id=0, bos_token_id=0, eos_token_id=2, max_position_embeddings=TINY_MAX_POSITIONS)


def build_actor(config, seed: int):
    """Random-init actor (fp32, Qwen3_5MoeForCausalLM or Qwen3MoeForCausalLM) with R3 routers installed."""
    torch.manual_seed(seed)
    return r3.install(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def save_checkpoint(model, tokenizer, path: str):
    """Hugging Face layout: config.json, model.safetensors, tokenizer files."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def load_actor(path: str):
    """(model fp32 with R3 routers, tokenizer) from a save_checkpoint directory."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"path: no config.json in {path!r}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return r3.install(model), AutoTokenizer.from_pretrained(path)


def load_config(path: str):
    """(config, tokenizer) of a save_checkpoint directory, without its weights (the Megatron backend reads each
    rank's shards from the files: mcore_weights.load_checkpoint_into_megatron)."""
    from transformers import AutoConfig
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"path: no config.json in {path!r}")
    return AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def hub_state_dict(model) -> dict:
    """The weights under the checkpoint's (Hub) names, experts one by one, as save_pretrained writes them:
    what an SGLang server's load_weights expects from /update_weights_from_distributed."""
    from transformers.core_model_loading import revert_weight_conversion
    return revert_weight_conversion(model, dict(model.state_dict()))


@torch.no_grad()
def round_to_bf16(model):
    """Round every parameter to bf16 and keep it in fp32 (emulates bf16 inference weights)."""
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


def load_weights_from_disk(model, path: str):
    """Copy the weights of the checkpoint at `path` into `model` (same architecture, strict).

    Goes through from_pretrained: transformers 5 saves MoE experts per expert (the original Hub
    layout) and converts them back to fused tensors on load.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model_path: no config.json in {path!r}")
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(fresh.state_dict(), strict=True)


def supports_engine_forward(model) -> bool:
    """engine_forward covers Qwen3-MoE (attention + routed MoE in every layer, rotary over the whole head); Qwen3.5's
    hybrid layers (Gated DeltaNet, gated attention, a shared expert) go through the transformers forward."""
    cfg = model.config
    return (getattr(cfg, "model_type", "") == "qwen3_moe" and cfg.hidden_act == "silu"
            and not getattr(cfg, "use_sliding_window", False)
            and getattr(model.model.rotary_emb, "inv_freq", torch.zeros(0)).numel() * 2 == cfg.head_dim
            and all(hasattr(getattr(layer, "mlp", None), "experts") for layer in model.model.layers))


DENSE_EXPERT_ROWS = 64  # up to this many tokens a forward computes its experts in two batched matmuls (decode steps)
GROUPED_EXPERT_ROWS = 24  # ... grouped by expert from this many tokens, every expert on every token below


class _Layer:
    """One decoder layer's weights as engine_forward reads them: q, k, v projections as one matrix with the input
    norm's weight folded in; the q / k norms as one per-head weight (nq + nk, D) with the attention scale folded into
    the q heads (rotary is linear, so scaling q before it is the same); the experts' down projections side by side,
    (E I, H)."""

    def __init__(self, layer):
        a, moe = layer.self_attn, layer.mlp
        nq, nk = a.config.num_attention_heads, a.config.num_key_value_heads
        self.nq, self.nk, self.D = nq, nk, a.head_dim
        self.eps1, self.ln2 = layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm
        w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # ((nq + 2 nk) D, H)
        self.wqkv = w * layer.input_layernorm.weight  # the input norm's weight folded in (it scales x's columns)
        self.qk_w = torch.cat([(a.q_norm.weight * a.scaling).expand(nq, -1), a.k_norm.weight.expand(nk, -1)])
        self.qk_eps = a.q_norm.variance_epsilon
        if a.k_norm.variance_epsilon != self.qk_eps:
            raise ValueError("engine_forward: q_norm and k_norm epsilons differ")
        self.wo_t = a.o_proj.weight.t()  # (nq D, H)
        self.gate = moe.gate  # the R3 router: live_route records where the engine's capture reads
        E, I2, H = moe.experts.gate_up_proj.shape
        self.E, self.I = E, I2 // 2
        self.wgu = moe.experts.gate_up_proj.reshape(E * I2, H)  # (E 2I, H), expert e's gate rows then up rows
        self.wd_t = moe.experts.down_proj.transpose(1, 2).reshape(E * self.I, H)  # (E I, H)
        self.experts = moe.experts
        self.wgu_b = moe.experts.gate_up_proj.transpose(1, 2).contiguous()  # (E, H, 2I): a copy (bmm is faster)
        self.wd_b = self.wd_t.view(E, self.I, H)  # (E, I, H)


def engine_layers(model) -> tuple:
    """(the model's _Layers, the output matrix with the final norm's weight folded in, the rotary cos and signed sin
    of every position (P, D)), cached on the model and rebuilt when any parameter changed: a weight load copies into
    the parameters, which bumps their version; a released parameter changes its storage (the engine also drops the
    cache then: drop_engine_layers)."""
    cached = model.__dict__.get("_engine_layers")
    if cached is not None and cached[1] == [(p.data_ptr(), p._version) for p in cached[0]]:
        return cached[2]
    params = list(model.parameters())
    with torch.no_grad():  # lm_head with the final norm's weight folded in; rotary tables of every position
        positions = torch.arange(model.config.max_position_embeddings)[None]
        cos, sin = model.model.rotary_emb(model.lm_head.weight, positions)  # (1, P, D), as a forward computes them
        half = cos.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # rotate_half's signs
        out = ([_Layer(layer) for layer in model.model.layers], model.lm_head.weight * model.model.norm.weight,
               cos[0], sin[0])
    model.__dict__["_engine_layers"] = (params, [(p.data_ptr(), p._version) for p in params], out)
    return out


def drop_engine_layers(model):
    """Free engine_forward's copies of the weights (the engine releasing its weights' memory)."""
    model.__dict__.pop("_engine_layers", None)


def _rms(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _experts(L, x, weights, ids, out):
    """Routed experts of tokens x (N, H) with routing weights / ids (N, k), added into out (N, H). Decode steps
    (N <= DENSE_EXPERT_ROWS) in one batched matmul up and one down: from GROUPED_EXPERT_ROWS tokens each expert on
    the tokens routed to it, padded to the busiest expert's count (E, cap, H) (k / E of the dense FLOPs plus the
    padding); fewer, every expert on every token weighted by the routing (0 off the top-k: no sort, no gather). More
    tokens (prefill): each expert on the tokens routed to it."""
    N = x.shape[0]
    if GROUPED_EXPERT_ROWS <= N <= DENSE_EXPERT_ROWS:
        k, E, I = ids.shape[1], L.E, L.I
        flat = ids.reshape(-1)  # (N k) expert of each (token, slot)
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=E)
        e = flat[order]
        slot = torch.arange(flat.numel()) - (counts.cumsum(0) - counts)[e]  # the pair's place in its expert's group
        idx = torch.zeros(E, int(counts.max()), dtype=torch.long)  # (E, cap) token of each place; padding: token 0
        wg = torch.zeros(idx.shape, dtype=x.dtype)  # ... with its routing weight; padding: 0 (adds nothing)
        idx[e, slot] = order // k
        wg[e, slot] = weights.reshape(-1)[order].to(x.dtype)
        gu = torch.bmm(x[idx], L.wgu_b)  # (E, cap, 2I)
        act = F.silu(gu[..., :I]).mul_(gu[..., I:]).mul_(wg[..., None])
        return out.index_add_(0, idx.view(-1), torch.bmm(act, L.wd_b).view(-1, x.shape[1]))
    if N <= DENSE_EXPERT_ROWS:
        gu = F.linear(x, L.wgu).view(N, L.E, 2 * L.I)
        act = F.silu(gu[..., :L.I]) * gu[..., L.I:]  # (N, E, I)
        route = torch.zeros(N, L.E, dtype=x.dtype).scatter_(1, ids, weights.to(x.dtype))  # (N, E)
        return torch.addmm(out, act.mul_(route[:, :, None]).view(N, -1), L.wd_t)
    for e in ids.unique().tolist():
        rows, slot = torch.where(ids == e)
        gate, up = F.linear(x[rows], L.experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, L.experts.down_proj[e]) * weights[rows, slot, None].to(x.dtype)
        out.index_add_(0, rows, y)
    return out


@torch.inference_mode()
def engine_forward(model, ids, pos, mask, cache):
    """A forward of the engine (a decode step, S = 1, or a prefill) for the Qwen3-MoE layout -> logits (B, V) of
    the last column: ids (B, S) left-padded, pos (B, S) their positions, mask (B, T) 1 on real columns (T = the
    cached columns + S), cache the attention layers' KV (this forward's columns are written into it).

    The transformers forward's math (RMSNorm, q / k norm, rotary, grouped-query attention, the softmax router: the
    installed R3 routers' live_route, which records where the engine's capture reads) in fewer operations, on
    engine_layers' weights: q, k, v in one matmul, norm weights folded into the matrices after them, q and k normed
    and rotated together (rotary from tables), residual adds fused into the output matmuls; a
    query attends to the real columns up to its own and always to itself (a padding query then stays finite, and no
    real query reads it); one query per row (decode) as one matmul with the mask added, a softmax and one matmul
    (the CPU flash kernel is slow for one query), more through SDPA; experts as _experts. Logits equal the
    transformers forward's to ~1e-6 (tests/test_engine.py)."""
    m, (layers, head, cos_t, sin_t) = model.model, engine_layers(model)
    B, S = ids.shape
    T = mask.shape[1]
    N = B * S
    h = m.embed_tokens(ids).view(N, -1)  # (N, H): the residual stream
    cos, sin = cos_t[pos][:, :, None], sin_t[pos][:, :, None]  # (B, S, 1, D)
    L0 = layers[0]
    nq, nk, D, half = L0.nq, L0.nk, L0.D, L0.D // 2
    if S == 1:  # the query is the last column: every real column, and itself
        bias = torch.zeros(B, T).masked_fill_(mask == 0, float("-inf"))
        bias[:, -1] = 0.0
        bias = bias.repeat_interleave(nk, 0)[:, None]  # (B nk, 1, T), each kv head's query group
    else:
        col = torch.arange(T)
        allowed = (mask.bool()[:, None, :] & (col[None, None, :] <= col[T - S:, None])) | \
            (col[None, None, :] == col[T - S:, None])  # (B, S, T)
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None]  # (B, 1, S, T)
    for i, L in enumerate(layers):
        qkv = F.linear(F.rms_norm(h, (h.shape[-1],), None, L.eps1), L.wqkv).view(B, S, nq + 2 * nk, D)
        qk = F.rms_norm(qkv[:, :, :nq + nk], (D,), None, L.qk_eps) * L.qk_w  # (B, S, nq + nk, D), q scaled
        qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # rotary: x cos + rotate_half(x) sin
        keys, values = cache.layers[i].update(qk[:, :, nq:].transpose(1, 2), qkv[:, :, nq + nk:].transpose(1, 2))
        if S == 1:  # (B nk, g, D) x (B nk, D, T): keys / values (B, nk, T, D) are views with mergeable rows
            w = torch.baddbmm(bias, qk[:, 0, :nq].reshape(B * nk, nq // nk, D), keys.reshape(B * nk, T, D).mT)
            o = torch.bmm(w.softmax(-1), values.reshape(B * nk, T, D)).view(N, nq * D)
        else:
            o = F.scaled_dot_product_attention(qk[:, :, :nq].transpose(1, 2), keys, values, attn_mask=bias, scale=1.0,
                                               enable_gqa=True).transpose(1, 2).reshape(N, nq * D)
        h = torch.addmm(h, o, L.wo_t)
        x = _rms(h, L.ln2.weight, L.ln2.variance_epsilon)
        weights, experts = L.gate.live_route(x)  # (N, k) each; R3Router: records into the engine's buffer
        h = _experts(L, x, weights, experts, h)
    return F.linear(F.rms_norm(h.view(B, S, -1)[:, -1], (h.shape[-1],), None, m.norm.variance_epsilon), head)
