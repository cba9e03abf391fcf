"""tito.py: assembly of token records into one sample, the loss mask, routing across turns, audit, I/O."""
import json
import subprocess
import sys

import numpy as np
import pytest

import tito
from chat_tokens import ASSISTANT_PREFIX, IM_END

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


def test_replay_refuses_a_trial_with_one_turn_capture_missing_naming_trial_and_engine_flag():
    trial = make_trial()
    trial["records"][1]["routed_experts"] = None  # an engine started without routed-expert capture
    with pytest.raises(tito.CaptureError, match=r"trial 't' turn 1: routed experts missing.*"
                                                r"--enable-return-routed-experts"):
        tito.assemble(trial, replay=True)
    trial = make_trial()
    trial["records"][2]["routed_experts"] = trial["records"][2]["routed_experts"][:-1]
    with pytest.raises(tito.CaptureError, match=r"turn 2.*expected \(\d+, 3, 2\)"):
        tito.assemble(trial, replay=True)
    with pytest.raises(tito.CaptureError, match=r"trial 't' turn 0"):
        tito.assemble(make_trial(with_routing=False), replay=True)


def test_without_replay_a_missing_capture_only_drops_the_routing():
    trial = make_trial()
    trial["records"][1]["routed_experts"] = None
    s = tito.assemble(trial)  # R3 off: routing is not needed to train
    assert s["routed_experts"] is None and s["loss_mask"].sum() == 9


def test_non_strict_boundary_is_refused():
    trial = make_trial(with_routing=False)
    trial["records"][1]["prompt_ids"][8] = 99  # the harness rewrote a sampled token
    with pytest.raises(ValueError, match="turn 0"):
        tito.assemble(trial)


def test_audit_reports_zero_drift_on_an_intact_sample():
    s = tito.assemble(make_trial())
    rep = tito.audit([s])
    assert rep["loss_region_drift_pct"] == 0.0 and rep["drifted_tokens"] == 0
    assert rep["loss_tokens"] == int(s["loss_mask"].sum()) == 9 and rep["relocation_failures"] == 0
    assert rep["cases"] == {"strict": 2, "normalized": 0, "retokenized": 0, "split": 0}


def test_audit_detects_one_corrupted_loss_region_token_and_reports_its_position():
    s = tito.assemble(make_trial())
    j = int(np.flatnonzero(s["loss_mask"])[4])  # a sampled token of turn 1
    s["tokens"][j] += 1
    rep = tito.audit([s])
    assert rep["drifted_tokens"] == 1 and rep["loss_region_drift_pct"] == pytest.approx(100 / 9)
    assert rep["drift"] == [{"task": "t", "segment": 0, "position": j, "trained": int(s["tokens"][j]),
                             "sampled": int(s["tokens"][j]) - 1, "mask": 1}]


def test_audit_detects_a_loss_mask_moved_off_the_sampled_tokens():
    s = tito.assemble(make_trial())
    j = int(np.flatnonzero(s["loss_mask"])[0])
    s["loss_mask"][j], s["loss_mask"][j - 1] = 0, 1  # the loss region slid one token left
    rep = tito.audit([s])
    assert rep["drifted_tokens"] == 2 and {d["position"] for d in rep["drift"]} == {j - 1, j}


def test_audit_reports_a_completion_not_relocated_in_the_next_prompt():
    trial = make_trial()
    n0 = len(trial["records"][0]["prompt_ids"])
    trial["records"][1]["prompt_ids"][n0 + 1] = 99  # the harness re-encoded turn 0's reply with another id
    trial["records"][2]["prompt_ids"][n0 + 1] = 99
    segs = tito.assemble_segments(trial)  # no tokenizer: the boundary is a split
    rep = tito.audit(segs)
    assert rep["relocation_failures"] == 1
    assert rep["relocation"] == [{"task": "t", "turn": 0, "case": "split", "position": n0 + 1, "sampled": 21,
                                  "found": 99}]
    assert rep["loss_region_drift_pct"] == 0.0  # each segment still trains on the sampled ids
    s = tito.assemble(make_trial())
    turns = tito.unpack_turns(s["turn_ids"])
    turns[2][0][len(turns[1][0]) + 1] = 98  # the records' copy of turn 1's reply corrupted
    s["turn_ids"] = tito.pack_turns(turns)
    rep = tito.audit([s])
    assert rep["relocation_failures"] == 1 and rep["relocation"][0]["turn"] == 1


def test_audit_refuses_samples_without_their_trial_records():
    s = tito.assemble(make_trial())
    del s["turn_ids"]
    with pytest.raises(ValueError, match="no turn_ids"):
        tito.audit([s])
    s = tito.assemble(make_trial())
    s["boundaries"] = s["boundaries"][:1]
    with pytest.raises(ValueError, match=r"3 turns need 2 boundaries"):
        tito.audit([s])
    s = tito.assemble(make_trial())
    s["boundaries"][0] = ["retokenized", 10**6]  # a repaired boundary the records do not support
    with pytest.raises(ValueError, match=r"turn 0: boundary declared retokenized"):
        tito.audit([s])
    s = tito.assemble(make_trial())
    s["loss_mask"] = s["loss_mask"][:-1]
    with pytest.raises(ValueError, match=r"tokens \(\d+,\) and loss_mask"):
        tito.audit([s])
    s = tito.assemble(make_trial())
    s["turn_ids"][1][0] = 10**6  # a shared prefix longer than the previous turn
    with pytest.raises(ValueError, match=r"shared prefix 1000000 is not in"):
        tito.audit([s])


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
    assert back[0]["turn_ids"] == samples[0]["turn_ids"] and back[0]["boundaries"] == samples[0]["boundaries"]
    recs = make_trial()["records"]
    assert tito.unpack_turns(back[0]["turn_ids"]) == [[r["prompt_ids"], r["output_ids"]] for r in recs]
    assert sum(len(t[1]) for t in back[0]["turn_ids"]) < sum(len(r["prompt_ids"]) for r in recs)  # packed


def test_cli_audit_fails_on_a_corrupted_sample_and_names_the_position(tmp_path):
    s = tito.assemble(make_trial())
    j = int(np.flatnonzero(s["loss_mask"])[-1])
    s["tokens"][j] = 77
    tito.save_samples(tmp_path / "step_000001.jsonl", [s])
    out = subprocess.run([sys.executable, "tito.py", "audit", str(tmp_path)], capture_output=True, text=True,
                         cwd=tito.__file__.rsplit("/", 1)[0])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "loss-region drift 11.1111% (1 of 9 loss tokens)" in out.stdout
    assert f"'position': {j}, 'trained': 77" in out.stdout


def test_load_samples_names_the_bad_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"tokens": "AAAA"}\n')
    with pytest.raises(ValueError, match="line 1"):
        tito.load_samples(p)


# --- the four boundary cases on constructed boundaries (real tokenizer) ---------------------------------

@pytest.fixture(scope="module")
def tok():
    import model
    texts = ['{"analysis": "hello world", "plan": "sort the lines", "commands": [], "task_complete": false}',
             "New terminal output:\n$ ls -la\nin.txt out.txt\n", "hello world " * 20] * 20
    return model.train_tokenizer(texts, vocab_size=400)


def chat_trial(tok, outputs, harness_copies, with_routing=True):
    """Turns whose next prompt = P_i + the harness's copy of O_i + <|im_end|>\\n + user message + header."""
    import model
    header = tok.encode(ASSISTANT_PREFIX, add_special_tokens=False)
    im_end, nl = tok.convert_tokens_to_ids(IM_END), tok.encode("\n", add_special_tokens=False)
    prompt = model.render_ids(tok, "user", "Task: sort in.txt") + header
    recs = []
    for i, out in enumerate(outputs):
        recs.append({"prompt_ids": list(prompt), "output_ids": list(out), "output_logprobs": [-0.5] * len(out),
                     "routed_experts": routing(len(prompt) + len(out) - 1, i) if with_routing else None})
        if i < len(harness_copies):
            prompt = prompt + harness_copies[i] + [im_end] + nl + model.render_ids(tok, "user", f"out {i}") + header
    return {"task": "chat", "reward": 0.5, "records": recs}


def reply_ids(tok, text, eot=True):
    return tok.encode(text, add_special_tokens=False) + ([tok.convert_tokens_to_ids("<|im_end|>")] if eot else [])


def non_canonical(tok, text):
    """Ids that decode to `text` but are not what the tokenizer would encode: the first merged token split in bytes."""
    ids = tok.encode(text, add_special_tokens=False)
    k = next(k for k, t in enumerate(ids) if len(tok.convert_ids_to_tokens(t)) > 1)
    parts = tok.convert_tokens_to_ids(list(tok.convert_ids_to_tokens(ids[k])))
    out = ids[:k] + parts + ids[k + 1:]
    assert out != ids and tok.decode(out) == text
    return out


def check_repaired(s, trial):
    """m = 1 exactly on the sampled ids, which sit unchanged in the stream; audit drift 0."""
    for (a, b), o in zip(s["spans"], s["sampled"]):
        assert list(s["tokens"][a:b]) == o and (s["loss_mask"][a:b] == 1).all()
    assert int(s["loss_mask"].sum()) == sum(b - a for a, b in s["spans"])
    assert (s["rollout_logprobs"][s["loss_mask"] == 1] == -0.5).all()
    assert (s["rollout_logprobs"][s["loss_mask"] == 0] == 0).all()
    if s["routed_experts"] is not None:
        assert s["routed_experts"].shape == (len(s["tokens"]) - 1, L, K)
    assert tito.audit([s])["loss_region_drift_pct"] == 0.0


def test_strict_boundary_with_tokenizer(tok):
    o0 = reply_ids(tok, '{"analysis": "hello world"}')
    trial = chat_trial(tok, [o0, reply_ids(tok, "{}")], [o0[:-1]])
    s = tito.assemble(trial, tok)
    assert s["cases"] == {"strict": 1, "normalized": 0, "retokenized": 0, "split": 0}
    assert list(s["tokens"]) == trial["records"][1]["prompt_ids"] + trial["records"][1]["output_ids"]
    check_repaired(s, trial)


def test_normalized_boundary_keeps_the_sampled_whitespace(tok):
    o0 = reply_ids(tok, '{"analysis": "hello world"}\n\n')        # the client strips the reply
    stripped = tok.encode('{"analysis": "hello world"}', add_special_tokens=False)
    trial = chat_trial(tok, [o0, reply_ids(tok, "{}")], [stripped])
    assert tito.classify_boundary(trial["records"][0]["prompt_ids"], o0, trial["records"][1]["prompt_ids"], tok)[0] \
        == "normalized"
    s = tito.assemble(trial, tok)
    assert s["cases"]["normalized"] == 1 and s["n_segments"] == 1
    check_repaired(s, trial)
    assert s["harness_drift_tokens"] > 0  # the harness's copy lost the sampled whitespace


def test_retokenized_boundary_trains_on_sampled_ids_not_the_reencoded_copy(tok):
    text = '{"analysis": "hello world", "plan": "sort the lines"}'
    o0 = non_canonical(tok, text) + [tok.convert_tokens_to_ids("<|im_end|>")]
    trial = chat_trial(tok, [o0, reply_ids(tok, "{}")], [tok.encode(text, add_special_tokens=False)])
    s = tito.assemble(trial, tok)
    assert s["cases"] == {"strict": 0, "normalized": 0, "retokenized": 1, "split": 0}
    check_repaired(s, trial)
    a, b = s["spans"][0]
    assert list(s["tokens"][a:b]) == o0                        # sampled ids in the loss region
    glue_start = b
    p1 = trial["records"][1]["prompt_ids"]
    assert (list(s["tokens"][glue_start:s["spans"][1][0]])
            == p1[p1.index(o0[-1], len(trial["records"][0]["prompt_ids"])) + 1:])
    naive = tito.audit([tito.assemble_naive(trial, tok)])
    assert naive["loss_region_drift_pct"] > 0                  # the re-encoded copy would have drifted
    assert tito.audit([s])["harness_drift_pct"] > 0


def test_split_boundary_starts_a_new_segment(tok):
    o0, o1 = reply_ids(tok, '{"analysis": "hello world"}'), reply_ids(tok, "{}")
    trial = chat_trial(tok, [o0, o1], [o0[:-1]])
    import model
    summary = (model.render_ids(tok, "user", "Summary: sorted.")
               + tok.encode(ASSISTANT_PREFIX, add_special_tokens=False))
    p1 = summary
    trial["records"][1]["prompt_ids"] = p1
    trial["records"][1]["routed_experts"] = routing(len(p1) + len(o1) - 1, 1)
    segs = tito.assemble_segments(trial, tok)
    assert len(segs) == 2 and [s["segment"] for s in segs] == [0, 1]
    assert segs[1]["cases"]["split"] == 1 and sum(s["cases"]["split"] for s in segs) == 1
    assert list(segs[1]["tokens"]) == p1 + o1 and all(s["reward"] == 0.5 for s in segs)
    for s in segs:
        check_repaired(s, trial)
    with pytest.raises(ValueError, match="turn 0.*split"):
        tito.assemble(trial, tok)


def test_all_four_cases_in_one_trajectory_audit_clean(tok, tmp_path):
    t = '{"analysis": "hello world", "plan": "sort the lines"}'
    outs = [reply_ids(tok, "{}"), reply_ids(tok, t + "\n"), non_canonical(tok, t) + reply_ids(tok, "", True),
            reply_ids(tok, "{}"), reply_ids(tok, "{}")]
    copies = [outs[0][:-1], tok.encode(t, add_special_tokens=False), tok.encode(t, add_special_tokens=False),
              outs[3][:-1]]
    trial = chat_trial(tok, outs, copies)
    import model
    p4 = model.render_ids(tok, "user", "Summary.") + tok.encode(ASSISTANT_PREFIX, add_special_tokens=False)
    trial["records"][4]["prompt_ids"] = p4
    trial["records"][4]["routed_experts"] = routing(len(p4) + len(outs[4]) - 1, 4)
    assert tito.case_counts(trial, tok) == {"strict": 1, "normalized": 1, "retokenized": 1, "split": 1}
    segs = tito.assemble_segments(trial, tok)
    rep = tito.audit(segs)
    assert rep["cases"] == {"strict": 1, "normalized": 1, "retokenized": 1, "split": 1}
    assert [(r["turn"], r["case"]) for r in rep["relocation"]] == [(1, "normalized"), (2, "retokenized"), (3, "split")]
    assert rep["loss_region_drift_pct"] == 0.0 and rep["loss_tokens"] == sum(len(o) for o in outs)
    tito.save_samples(tmp_path / "s.jsonl", segs)
    out = subprocess.run([sys.executable, "tito.py", "audit", str(tmp_path / "s.jsonl"), "--json"], capture_output=True,
                         text=True, check=True, cwd=tito.__file__.rsplit("/", 1)[0])
    back = json.loads(out.stdout)
    assert back["cases"] == rep["cases"] and back["loss_region_drift_pct"] == 0.0 and back["samples"] == 2
