"""infra.py: memory model (Proposition 7.1), planner, parameter counts; cluster/cp_gdn.py: context-parallel Gated
DeltaNet."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import mechanisms
from cluster import cp_gdn
import infra
from infra import GiB, MODEL_SHAPES, Plan

C122 = MODEL_SHAPES["qwen35-122b-a10b"]
ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- memory model and planner
@pytest.mark.parametrize("preset", sorted(MODEL_SHAPES))
@pytest.mark.parametrize("gpus", [16, 64, 128])
def test_prop_7_1_expert_optimizer_bytes_do_not_depend_on_plan(preset, gpus):
    c = MODEL_SHAPES[preset]
    p_exp = infra.param_counts(c)["expert"]
    plans = infra.enumerate_plans(c, gpus, tokens=16384)
    assert len({(p.tp, p.pp, p.cp, p.ep, p.etp) for p in plans}) > 50  # many genuinely different plans
    for p in plans:
        for net in ("actor", "critic"):
            for stage in {0, p.pp - 1}:
                d = infra.device_memory(c, p, 16384, net, stage)
                assert math.isclose(d["expert_optimizer"], 12 * p_exp / gpus, rel_tol=1e-12), p


def test_param_count_matches_paper_totals():
    n = infra.param_counts(C122)
    assert abs(n["total"] / 121.4e9 - 1) < 0.02  # 122.1B with the assumed head layout (+0.6%)
    assert abs(n["expert"] / 116.0e9 - 1) < 0.005
    assert abs(infra.param_counts(MODEL_SHAPES["qwen35-35b-a3b"])["total"] / 35e9 - 1) < 0.05


def test_param_formula_matches_hf_qwen35_moe_module():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
    hf = Qwen3_5MoeTextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                              linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    model = Qwen3_5MoeForCausalLM(hf)
    mine = infra.ModelConfig("tiny", 4, 64, 8, 2, 32, 48, 3, 1, 512, 4, 2, 16, 2, 4, 8, 8)
    assert infra.param_counts(mine)["total"] == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert infra.param_counts(mine)["expert"] == experts


def test_plan_errors_follow_megatron_rules():
    ok = Plan(tp=2, pp=4, cp=2, ep=16, etp=1, dp=4)
    assert infra.plan_errors(C122, ok, 16384) == []
    assert ok.world == 64 and ok.edp == 1
    assert any("KV heads" in e for e in infra.plan_errors(C122, Plan(4, 1, 1, 16, 1, 16), 16384))
    assert any("layers" in e for e in infra.plan_errors(C122, Plan(1, 5, 1, 1, 1, 1), 16384))
    assert any("experts" in e for e in infra.plan_errors(C122, Plan(1, 1, 3, 3, 1, 1), 16384))
    assert any("EP*ETP" in e for e in infra.plan_errors(C122, Plan(1, 1, 1, 64, 1, 32), 16384))
    assert any("chunk" in e for e in infra.plan_errors(C122, Plan(1, 1, 2, 2, 1, 1), 1000))


def test_planner_rejects_infeasible_plans_with_reason():
    rows = infra.plan_table(C122, 64, 16384, mem_gib=95)
    feasible = [r for r in rows if r["feasible"]]
    assert feasible and len(feasible) < len(rows)
    for r in feasible:
        assert r["actor"]["total"] <= 95 * GiB and r["critic"]["total"] <= 95 * GiB
    no_rc = [r for r in rows if not r["recompute"] and r["tp"] == 2 and r["pp"] == 1 and r["ep"] == 64]
    assert no_rc and all(not r["feasible"] and "largest term: activations" in r["reason"] for r in no_rc)
    # a budget below the expert optimizer shard alone rejects every plan, naming the network and M
    tiny = infra.plan_table(C122, 64, 16384, mem_gib=20)
    assert not any(r["feasible"] for r in tiny) and all("actor total" in r["reason"] for r in tiny)
    ok, reason, _ = infra.feasibility(C122, Plan(2, 1, 1, 64, 1, 32), 16384, 95 * GiB, seq_len=131072)
    assert not ok and "CP*T = 16384 < seq_len 131072" in reason


def test_recompute_and_tp_shrink_activations():
    p = Plan(2, 1, 1, 64, 1, 32, recompute=False)
    full = infra.memory(C122, p, 8192)["activations"]
    rc = infra.memory(C122, Plan(2, 1, 1, 64, 1, 32, recompute=True), 8192)["activations"]
    tp1 = infra.memory(C122, Plan(1, 1, 1, 64, 1, 64, recompute=True), 8192)["activations"]
    assert rc < full / 5 and tp1 > rc
    critic = infra.memory(C122, Plan(2, 1, 1, 64, 1, 32), 8192, "critic")
    assert critic["activations"] < rc and critic["params"] < infra.memory(C122, p, 8192)["params"]


def test_memory_model_counts_the_behaviour_copy_and_keeps_published_versions_on_host():
    p = Plan(2, 1, 1, 64, 1, 32, recompute=True)
    a = infra.memory(C122, p, 16384)
    assert a["behaviour"] == a["params"] > 8 * GiB  # trainer.Trainer.behaviour: one bf16 copy of the shard
    assert a["host"] == infra.PUBLISHED_VERSIONS * a["params"]  # Trainer.mark_published: versions t-1, t on host
    assert a["total"] == sum(v for k, v in a.items() if k not in ("total", "host"))
    assert infra.memory(C122, p, 16384, "critic")["behaviour"] == 0
    # at the margin: the 128-GPU plan that was first before the behaviour copy was counted no longer fits M = 95
    edge = Plan(1, 1, 1, 128, 1, 128, recompute=True)
    assert infra.feasibility(C122, edge, 16384, 95 * GiB, behaviour_copies=0)[0]
    ok, reason, _ = infra.feasibility(C122, edge, 16384, 95 * GiB)
    assert not ok and "actor total" in reason
    first = next(r for r in infra.plan_table(C122, 128, 16384, 95) if r["feasible"])
    assert (first["tp"], first["ep"], first["dp"]) != (1, 128, 128)
    # the 64-GPU first plan fits only because the published versions are in host memory
    assert infra.feasibility(C122, p, 16384, 95 * GiB)[0]
    assert not infra.feasibility(C122, p, 16384, 95 * GiB, published_on_device=True)[0]


def test_trainer_keeps_published_versions_as_host_copies(tmp_path):
    import dataclasses
    import model as M
    import train_t1 as T
    import trainer
    tok = M.train_tokenizer(["ls -la /app\n", "cat notes.txt | wc -l\n"] * 20, vocab_size=300)
    M.save_checkpoint(M.build_actor(M.tiny_config(len(tok)), seed=0), tok, tmp_path / "sft")
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    tr = trainer.Trainer(dataclasses.replace(T.EMBEDDED, run_dir=str(tmp_path / "run"), torch_threads=1),
                         str(tmp_path / "sft"), 0)
    for v in (0, 1, 2):
        tr.mark_published(v)
    assert sorted(tr.published) == [1, 2]  # the last two versions, as PUBLISHED_VERSIONS says
    for name, w in tr.actor.state_dict().items():
        snap = tr.published[2][name]
        assert snap.device.type == "cpu" and torch.equal(snap, w) and snap.data_ptr() != w.data_ptr()


def test_plan_cli_json_interface():
    out = subprocess.run([sys.executable, "infra.py", "plan", "--preset", "qwen35-35b-a3b", "--gpus", "8", "--json"],
                         capture_output=True, text=True, check=True, cwd=infra.__file__.rsplit("/", 1)[0])
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    r = rows[0]
    assert {"tp", "pp", "cp", "ep", "etp", "dp", "feasible", "reason", "actor", "critic"} <= set(r)
    assert {"params", "behaviour", "grads", "optimizer", "expert_optimizer", "activations", "total",
            "host"} <= set(r["actor"])


# ----------------------------------------------------------------------------- context-parallel GDN
def test_help_answers_before_torch_loads():
    """`python infra.py --help` and `plan --help` answer from a standard-library parser, before torch loads; every
    flag's help line shows its default (--gpus: required)."""
    for argv in (["infra.py", "--help"], ["infra.py", "plan", "--help"]):
        code = (f"import runpy, sys\nsys.argv = {argv!r}\ntry:\n    runpy.run_path('infra.py', run_name='__main__')\n"
                "except SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "TORCH False" in out.stdout, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert "(default: 16384)" in text and "(required)" in text and "(default: qwen35-122b-a10b)" in text


def test_infra_imports_the_standard_library_only():
    """`import infra` and a whole `python infra.py plan` run load no torch (the rollout workers, the Ray driver and
    the planner import infra; torch comes where a function needs it)."""
    code = ("import runpy, sys\nimport infra\nprint('IMPORT', 'torch' in sys.modules)\n"
            "sys.argv = ['infra.py', 'plan', '--gpus', '8', '--preset', 'qwen35-35b-a3b', '--top', '1']\n"
            "try:\n    runpy.run_path('infra.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e\nprint('PLAN', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "IMPORT False" in out.stdout and "PLAN False" in out.stdout and "feasible" in out.stdout, out.stdout[-2000:]


def test_host_store_holds_its_port_until_the_ranks_join():
    """A group's rendezvous port is bound from the moment it is picked (free_port's was free only when picked: a
    suite's gloo group lost it to another process); ranks joining as clients share keys through it."""
    import datetime
    import socket
    import torch.distributed as dist
    store = infra.host_store(timeout_s=30)
    with socket.socket() as other, pytest.raises(OSError, match="(?i)address already in use"):
        other.bind(("127.0.0.1", store.port))
    t = datetime.timedelta(seconds=30)
    a, b = (dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=t) for _ in range(2))
    a.set("rank0", "here")
    assert b.get("rank0") == b"here"
    assert store.get("rank0") == b"here"


def test_cp_split_on_chunk_boundaries():
    assert cp_gdn.cp_split(300, 4) == [(0, 128), (128, 192), (192, 256), (256, 300)]
    for s, e in cp_gdn.cp_split(1000, 8)[:-1]:
        assert s % 64 == 0 and e % 64 == 0


def test_single_rank_rule_bitwise_equals_transformers_reference():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule
    (q, k, v, g, beta), _ = cp_gdn.gdn_inputs(S=200)  # a partial last chunk exercises the padding
    ref, ref_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                  output_final_state=True)
    out, state = cp_gdn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref) and torch.equal(state, ref_state)


@pytest.mark.parametrize("kappa", [2, 4])
def test_cp_forward_bitwise_and_grad_error(kappa):
    shape = dict(B=1, S=300, nk=2, nv=4, dk=16, dv=16)  # 5 chunks, the last one partial
    ref_out, ref_grads, ref_bytes = cp_gdn.reference_gdn(shape)
    out, grads, nbytes = mechanisms.run_cp(kappa, shape)
    assert torch.equal(out, ref_out)  # bitwise identical forward
    assert max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)) < 1e-6
    assert max(nbytes) < ref_bytes * (1 / kappa + 0.25)  # per-rank saved activations shrink ~1/kappa


def test_pin_cores_splits_the_cores_and_pins_every_thread_of_a_process():
    """--pin-cores: two disjoint halves covering this process's cores; infra.pin moves the threads a process already
    runs (Ray's, torch's) too, not only the calling one (sched_setaffinity is per thread)."""
    trainer_cores, rollout_cores = infra.core_split()
    assert trainer_cores and rollout_cores and not set(trainer_cores) & set(rollout_cores)
    assert set(trainer_cores) | set(rollout_cores) == os.sched_getaffinity(0)
    code = ("import os, threading, time, infra; ev = threading.Event(); "
            "t = threading.Thread(target=ev.wait, daemon=True); t.start(); infra.pin([%d]); "
            "print(sorted({c for tid in os.listdir('/proc/self/task') for c in os.sched_getaffinity(int(tid))})); "
            "print(len(os.listdir('/proc/self/task')))" % rollout_cores[0])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).resolve().parent.parent)).stdout.split()
    assert out[0] == f"[{rollout_cores[0]}]" and int(out[1]) >= 2, out  # every thread (>= 2) on the one core
