"""The one-GPU check (`python -m cluster.launch gpu-check [--out DIR]`): what a single lent GPU can tell about the
cluster path before a cluster is booked. The trainer's cluster model runs a few real steps (the trainer bench, tiny
and a 122B-width slice), the memory model (infra.py) is held against the real allocation of a probe model, and the
Megatron tests run on this node's torch and Megatron-Core. Each check is written to OUT/gpu_check.json as it finishes,
so a run cut off by the device's time limit still returns what it measured; the last lines are a short table.

`probe_config` / `hf_config`: the probe model (a small member of the Qwen3.5-MoE family) as infra.py's ModelConfig
and as the Hugging Face config of the same shape (the trainer bench builds its models from these too).
"""
import json
import os
import subprocess
import sys

import infra


def probe_config():
    """A small member of the Qwen3.5-MoE family for one GPU (infra.ModelConfig)."""
    return infra.ModelConfig("probe", n_layers=4, hidden=1024, n_experts=16, top_k=4, moe_ffn=512, shared_ffn=512,
                             n_gdn=3, n_attn=1, vocab=32768, n_heads=8, n_kv_heads=2, head_dim=128,
                             lin_k_heads=4, lin_v_heads=8, lin_k_dim=128, lin_v_dim=128)


def hf_config(c):
    from transformers import Qwen3_5MoeTextConfig
    every = c.n_layers // c.n_attn
    return Qwen3_5MoeTextConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.n_layers,
        layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(c.n_layers)],
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        linear_num_key_heads=c.lin_k_heads, linear_num_value_heads=c.lin_v_heads, linear_key_head_dim=c.lin_k_dim,
        linear_value_head_dim=c.lin_v_dim, linear_conv_kernel_dim=c.conv_kernel, num_experts=c.n_experts,
        num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_ffn, shared_expert_intermediate_size=c.shared_ffn,
        router_aux_loss_coef=0.0, tie_word_embeddings=c.tie_embeddings, max_position_embeddings=65536)


def measure_static(c, device="cuda"):
    """Bytes of Megatron's mixed-precision layout for c on one device, allocated for real: bf16 weights,
    fp32 main grads, fp32 master + Adam m, v (distributed optimizer at W = 1)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(hf_config(c)).to(torch.bfloat16)
    params = [p for p in model.parameters()]
    grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    master = [p.detach().float() for p in params]
    m, v = [torch.zeros_like(x) for x in master], [torch.zeros_like(x) for x in master]
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated() - base
    return model, static, (grads, master, m, v)


def gpu_check_table(res) -> str:
    """gpu_check's result as a short markdown table: each check, ok, its figure."""
    lines = ["| check | ok | figure |", "|---|---|---|"]
    for ch in res["checks"]:
        r = ch.get("result") or {}
        if "ratio" in ch:
            fig = f"measured / predicted {ch['ratio']:.2f}"
        elif r.get("steps"):
            first, last = r["steps"][0], r["steps"][-1]
            fig = (f"peak / predicted {r.get('peak_over_predicted')}, step {last['seconds']} s "
                   f"({last['tokens_per_s']} tok/s), abs dlogp {first['dlogp']:.2e} "
                   f"(R3 off {first['dlogp_r3_off']:.2e}), "
                   f"{r.get('transformer_impl')} / {r.get('dispatcher')} / {r.get('optimizer')}")
        else:
            fig = str(ch.get("error") or ch.get("tail") or "")[-100:].replace("\n", " ").replace("|", "/")
        lines.append(f"| {ch['name']} | {ch.get('ok')} | {fig} |")
    return "\n".join(lines)


def gpu_check(out_dir=None, tokens=(2048, 4096)):
    """One GPU: (0) the trainer's cluster model (`python -m experiments.bench trainer`, tiny and a 122B-width slice:
    bf16, Megatron's distributed optimizer, TE / DeepEP where they import, real train_steps with R3 replay, peak
    memory vs infra's prediction); (1) infra.py's predicted vs measured bytes: the static terms (params + grads +
    optimizer) on the real allocation, and activations (no recompute) from peak - static of one forward + backward
    of the HF model (torch reference GDN path, not FLA); (2) tests/test_mcore_te.py with the GPU visible and the
    Megatron CPU suite tests/test_mcore.py with it hidden, the slowest last.
    Each check is printed and written to OUT/gpu_check.json as it finishes, so a run cut off by the device's time
    limit still returns what it measured."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("[gpu-check] no CUDA device visible")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": []}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

    def done(check):
        if "ratio" in check:
            check["ok"] = 0.5 <= check["ratio"] <= 2.0  # the memory model is a planning tool: same order, not exact
        res["checks"].append(check)
        print(f"[gpu-check] {json.dumps(check, default=str)[:3000]}", flush=True)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
                f.write(json.dumps(res, indent=1, default=str))

    # the cluster model in the trainer: the trainer's Megatron path on this GPU, bf16 + Megatron's distributed
    # optimizer (+ TE / DeepEP where they import), a few real train_steps with R3 replay of the HF model's routing;
    # its peak memory against infra's prediction. First: the check that matters most.
    for shape, tokens_, samples, limit in (("t1-tiny", 512, 4, 150), ("122b-slice", 1024, 2, 330)):
        name = f"trainer bench {shape} (bf16, cluster preset)"
        try:
            r = subprocess.run([sys.executable, "-m", "experiments.bench", "trainer", "--shape", shape, "--tokens",
                                str(tokens_), "--samples", str(samples), "--steps", "3", "--preset",
                                "qwen35-122b-a10b"], cwd=here, capture_output=True, text=True, timeout=limit)
            out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
            done({"name": name, "ok": r.returncode == 0, "result": out,
                  "tail": None if out else (r.stdout + r.stderr)[-3000:]})
        except Exception as e:  # a failure or timeout is reported (with its output so far); the checks below still run
            part = getattr(e, "stderr", None) or b""
            done({"name": name, "ok": False, "error": repr(e)[-300:],
                  "tail": (part.decode(errors="replace") if isinstance(part, bytes) else part)[-3000:] or None})
    c, plan = probe_config(), infra.Plan(1, 1, 1, 1, 1, 1, recompute=False)
    try:
        model, static, _keep = measure_static(c)
        pred = infra.device_memory(c, plan, tokens[0], "actor", overhead_gib=0.0)
        pred_static = pred["params"] + pred["grads"] + pred["optimizer"] + pred["expert_optimizer"]
        done({"name": "static bytes (bf16 + fp32 grads + 12 B/param)", "measured": static,
              "predicted": pred_static, "ratio": static / pred_static})
        for T in tokens:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            ids = torch.randint(0, c.vocab, (1, T), device="cuda")
            loss = model(input_ids=ids, labels=ids).loss
            peak_fwd = torch.cuda.max_memory_allocated() - before
            loss.backward()
            model.zero_grad(set_to_none=True)
            pred = infra.device_memory(c, plan, T, "actor", overhead_gib=0.0)
            done({"name": f"activations T={T} (HF torch path, no recompute)", "measured": peak_fwd,
                  "predicted": pred["activations"], "ratio": peak_fwd / pred["activations"]})
            del loss, ids
        del model, _keep
        torch.cuda.empty_cache()
    except Exception as e:
        done({"name": "memory model", "ok": False, "error": repr(e)[-1500:]})
    # test_mcore_te.py with the GPU visible (T1_TEST_GPU=1: its TE test needs one); test_mcore.py is the CPU suite
    # (models built with CPU initialisation, which Megatron moves to a visible GPU: the first GPU run's failure), so
    # it runs as tests/conftest.py runs it by default, the GPU hidden: the suite on this node's torch and Megatron-Core
    for name, test, limit, env in (("mcore TE layout (GPU)", "tests/test_mcore_te.py", 240, {"T1_TEST_GPU": "1"}),
                                   ("mcore pytest (CPU suite, GPU hidden)", "tests/test_mcore.py", 420, {})):
        if not os.path.isfile(os.path.join(here, test)):
            continue
        try:  # own process (its NCCL group); a failure or timeout is reported, the checks after it still run
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-x", test], cwd=here,
                               capture_output=True, text=True, timeout=limit, env={**os.environ, **env})
            ok = False if r.returncode else None if "skipped" in r.stdout else True  # skipped: not checked here
            done({"name": name, "ok": ok, "tail": (r.stdout + r.stderr)[-3000:]})
        except Exception as e:
            done({"name": name, "ok": False, "error": repr(e)[-500:]})
    print(json.dumps(res, indent=1, default=str))
    print(gpu_check_table(res))
    return res
