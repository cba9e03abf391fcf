"""gateway.py: OpenAI-compatible token gateway over the real embedded engine; Harbor's Terminus-2 through it."""
import json
import os
import shutil

import pytest

import gateway
import model
import rollout
import tito

TEXTS = ['{"analysis": "hello world", "plan": "sort the lines", "commands": [], "task_complete": false}',
         "New terminal output:\n$ ls -la\nin.txt out.txt\n"] * 20


@pytest.fixture(scope="module")
def tok():
    return model.train_tokenizer(TEXTS, vocab_size=400)


@pytest.fixture(scope="module")
def engine(tok, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "actor")
    model.save_checkpoint(model.build_actor(model.tiny_config(len(tok)), seed=0), tok, path)
    eng = model.EngineServer(path, port=0, max_batch=4).start()
    yield eng
    eng.stop()


@pytest.fixture()
def gw(engine, tok, request):
    g = gateway.Gateway(engine.url, tok, getattr(request, "param", "tito"), max_new_tokens=16).start()
    yield g
    g.stop()


def test_round_trip_text_out_ids_recorded_same_as_generate(gw, engine, tok):
    msgs = [{"role": "user", "content": "sort the lines"}]
    r = gateway.chat_completion(gw.url, msgs, "s", temperature=0.0, max_tokens=12, logprobs=True, return_token_ids=True)
    rec = gw.trial("s")["records"][0]
    ch = r["choices"][0]
    assert ch["token_ids"] == rec["output_ids"] and r["prompt_token_ids"] == rec["prompt_ids"]
    assert rec["prompt_ids"] == tok.encode(gw.render(msgs), add_special_tokens=False)
    assert [c["logprob"] for c in ch["logprobs"]["content"]] == rec["output_logprobs"]
    assert rec["routed_experts"].shape[0] == len(rec["prompt_ids"]) + len(rec["output_ids"]) - 1
    direct = rollout.EngineClient(engine.url).generate(rec["prompt_ids"], {"temperature": 0.0, "max_new_tokens": 12,
                                                                         "stop_token_ids": [2]})
    assert direct["output_ids"] == rec["output_ids"]  # greedy: the same ids /generate returns
    assert ch["message"]["content"] == tok.decode([t for t in rec["output_ids"] if t != 2], skip_special_tokens=True)


def test_tito_splices_the_sampled_ids_so_every_boundary_is_strict(gw, tok):
    msgs = [{"role": "user", "content": "sort the lines"}]
    for i in range(3):
        r = gateway.chat_completion(gw.url, msgs, "t", max_tokens=16)
        msgs += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                 {"role": "user", "content": f"New terminal output:\n$ ls {i}\n"}]
    trial = gw.pop("t")
    assert [r["prompt_source"] for r in trial["records"]] == ["fresh", "spliced", "spliced"]
    s = tito.assemble(trial, tok)
    assert s["cases"]["strict"] == 2 and tito.audit([s])["loss_region_drift_pct"] == 0.0


@pytest.mark.parametrize("gw", ["naive"], indirect=True)
def test_naive_mode_reencodes_and_prefix_match_finds_the_session(gw, tok):
    msgs = [{"role": "user", "content": "sort the lines"}]
    for i in range(3):  # no session id: the gateway finds the trial by prefix
        r = gateway.chat_completion(gw.url, msgs, None, max_tokens=16)
        msgs += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                 {"role": "user", "content": f"out {i}"}]
    (sid, turns), = gw.sessions.items()
    recs = gw.trial(sid)["records"]
    assert len(recs) == 3 and all(r["prompt_source"] == "fresh" for r in recs)
    assert recs[-1]["prompt_ids"] == tok.encode(gw.render(msgs[:-2]), add_special_tokens=False)
    segs = tito.assemble_segments(gw.trial(sid), tok)
    assert tito.audit(segs)["loss_region_drift_pct"] == 0.0  # repaired: sampled ids in the loss region


needs_sandbox = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap") or not shutil.which("tmux"),
                                   reason="the bubblewrap environment needs root, bwrap and tmux")


@needs_sandbox
@pytest.mark.skipif(gateway.harbor_available() is not None, reason=str(gateway.harbor_available()))
def test_harbor_terminus2_trial_through_the_gateway(gw, tok, tmp_path):
    from test_rollout import make_task
    task = make_task(tmp_path)
    res = gateway.run_harbor_trial(task, gw, trials_dir=str(tmp_path / "trials"), sampling={"max_new_tokens": 64},
                                   limits={"max_turns": 1, "trial_timeout_s": 300})
    assert res["exit_reason"] == "harbor", res
    assert res["records"] and res["turns"] == len(res["records"])
    # Harbor's own rollout details (collect_rollout_details) carry the ids the gateway recorded
    result = json.load(open(os.path.join(res["trial_dir"], "result.json")))
    details = result["agent_result"]["rollout_details"][0]
    # (Harbor keeps only replies it accepted; truncated ones it re-asks are recorded by the gateway too)
    ours = [(r["prompt_ids"], r["output_ids"]) for r in res["records"]]
    theirs = list(zip(details["prompt_token_ids"], details["completion_token_ids"]))
    assert theirs and all(t in ours for t in theirs)
    assert [ours.index(t) for t in theirs] == sorted(ours.index(t) for t in theirs)
    # the verifier ran in the jail: a CTRF report with the task's 3 assertions, read with reward.compute
    assert res["reward_source"] == "ctrf" and res["total"] == 3
    assert tito.case_counts(res, tok)["strict"] == len(res["records"]) - 1
    s = tito.assemble(res, tok)
    assert tito.audit([s])["loss_region_drift_pct"] == 0.0
