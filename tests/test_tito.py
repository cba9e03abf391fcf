"""tito.py: assembly of token records into one sample, the loss mask, routing across turns, audit, I/O."""
import json
import subprocess
import sys

import numpy as np
import pytest

import tito

L, K = 3, 2


def routing(n, seed):
    return np.random.default_rng(seed).integers(0, 8, size=(n, L, K)).astype(np.int32)


def make_trial(with_routing=True):
    """Three turns as the token-first harness records them: prompt_{i+1} = prompt_i + out_i + glue_i."""
    p0 = [1, 5, 6, 7, 2, 1, 9]                 # system/user turn + assistant header
    o0 = [20, 21, 22, 2]                       # sampled, ends with <|im_end|>
    p1 = p0 + o0 + [10, 1, 11, 30, 31, 2, 1, 9]   # glue + tool output + header (m = 0)
    o1 = [23, 24, 2]
    p2 = p1 + o1 + [10, 1, 11, 32, 2, 1, 9]
    o2 = [25, 2]
    recs = []
    for i, (p, o) in enumerate([(p0, o0), (p1, o1), (p2, o2)]):
        recs.append({"prompt_ids": p, "output_ids": o, "output_logprobs": [-0.1 * (i + 1)] * len(o),
                     "routed_experts": routing(len(p) + len(o) - 1, i) if with_routing else None,
                     "finish_reason": "stop", "weight_version": 3})
    return {"task": "t", "reward": 0.15, "passed": 3, "total": 4, "reward_source": "ctrf",
            "exit_reason": "task_complete", "records": recs}


def test_loss_mask_is_one_exactly_on_sampled_tokens():
    trial = make_trial()
    s = tito.assemble(trial)
    recs = trial["records"]
    assert list(s["tokens"]) == recs[-1]["prompt_ids"] + recs[-1]["output_ids"]
    expected = np.zeros(len(s["tokens"]), dtype=np.int8)
    for r in recs:
        expected[len(r["prompt_ids"]): len(r["prompt_ids"]) + len(r["output_ids"])] = 1
        assert list(s["tokens"][len(r["prompt_ids"]): len(r["prompt_ids"]) + len(r["output_ids"])]) == r["output_ids"]
    assert (s["loss_mask"] == expected).all()
    assert (s["rollout_logprobs"][s["loss_mask"] == 0] == 0).all()
    assert s["cases"] == {"strict": 2, "normalized": 0, "retokenized": 0, "split": 0}


def test_routing_rows_come_from_the_forward_that_first_computed_them():
    trial = make_trial()
    s = tito.assemble(trial)
    re = s["routed_experts"]
    r0, r1, r2 = (r["routed_experts"] for r in trial["records"])
    n0, n1 = len(r0), len(r1)
    assert re.shape == (len(s["tokens"]) - 1, L, K)
    assert (re[:n0] == r0).all()           # turn 0: prefill + decode rows of the sampler
    assert (re[n0:n1] == r1[n0:n1]).all()  # tool output rows from the next turn's prefill
    assert (re[n1:] == r2[n1:]).all()


def test_missing_or_misshaped_capture_raises_with_trial_and_turn():
    trial = make_trial()
    trial["records"][1]["routed_experts"] = None
    with pytest.raises(ValueError, match=r"trial 't' turn 1: routed experts missing"):
        tito.assemble(trial)
    trial = make_trial()
    trial["records"][2]["routed_experts"] = trial["records"][2]["routed_experts"][:-1]
    with pytest.raises(ValueError, match=r"turn 2.*expected \(\d+, 3, 2\)"):
        tito.assemble(trial)


def test_non_strict_boundary_is_refused():
    trial = make_trial(with_routing=False)
    trial["records"][1]["prompt_ids"][8] = 99  # the harness rewrote a sampled token
    with pytest.raises(ValueError, match="turn 0"):
        tito.assemble(trial)


def test_audit_reports_zero_drift_and_detects_drift():
    s = tito.assemble(make_trial())
    rep = tito.audit([s])
    assert rep["loss_region_drift_pct"] == 0.0 and rep["loss_tokens"] == int(s["loss_mask"].sum())
    s["relocated"][0][1] += 1  # one completion token not found where it was sampled
    rep = tito.audit([s])
    assert rep["drifted_tokens"] == 1 and rep["loss_region_drift_pct"] > 0


def test_samples_round_trip_exactly_and_cli_audits_them(tmp_path):
    samples = [tito.assemble(make_trial()), tito.assemble(make_trial(with_routing=False))]
    path = tmp_path / "step_000001.jsonl"
    tito.save_samples(path, samples)
    back = tito.load_samples(path)
    for a, b in zip(samples, back):
        assert (a["tokens"] == b["tokens"]).all() and (a["loss_mask"] == b["loss_mask"]).all()
        assert (a["rollout_logprobs"] == b["rollout_logprobs"]).all()  # bit for bit
        assert (a["routed_experts"] is None) == (b["routed_experts"] is None)
        if a["routed_experts"] is not None:
            assert (a["routed_experts"] == b["routed_experts"]).all()
    out = subprocess.run([sys.executable, "tito.py", "audit", str(tmp_path), "--json"], capture_output=True,
                         text=True, check=True, cwd=tito.__file__.rsplit("/", 1)[0])
    rep = json.loads(out.stdout)
    assert rep["samples"] == 2 and rep["loss_region_drift_pct"] == 0.0 and rep["cases"]["strict"] == 4


def test_load_samples_names_the_bad_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"tokens": "AAAA"}\n')
    with pytest.raises(ValueError, match="line 1"):
        tito.load_samples(p)
