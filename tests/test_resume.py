"""Resume never duplicates or loses (rundir.resume_run, the commit point state.json).

Fast tests on the save / load helpers and on an in-process Trainer: a checkpoint newer than state.json (a kill
between the trainer's save and the commit) is discarded and its step redone exactly once; a kill between the
checkpoint renames, a run dir without state.json, a torn metrics line, corrupt files, an unfinished SFT or
warm-up. The end-to-end one (a run killed with SIGKILL in the middle of an RL step resumes to the same step count
with nothing lost or duplicated) shares the tiny pipeline run of tests/test_e2e.py."""
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import rundir
import train_t1 as T
import trainer as TR


ARGS = dataclasses.replace(T.EMBEDDED, minibatch_size=3, ppo_epochs=1, actor_lr=1e-3, critic_lr=1e-3,
                           torch_threads=1)


def fake_ckpt(d: Path, step) -> Path:
    """A checkpoint directory as save_trainer leaves it (weights file + step.json; step None: incomplete)."""
    d.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, str(d / "model.safetensors"))
    if step is not None:
        (d / "step.json").write_text(json.dumps({"step": step}))
    return d


def write_jsonl(path: Path, rows: list, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def rows(path: Path) -> list:
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_checkpoint_newer_than_state_is_discarded_and_the_step_redone_once(tmp_path, tiny_sft):
    sft, samples = str(tiny_sft.sft), tiny_sft.samples

    def trainer(run, step):
        (run / "ckpt").mkdir(parents=True, exist_ok=True)
        t = TR.Trainer(dataclasses.replace(ARGS, run_dir=str(run)), sft, step)
        t.mark_published(step)  # the engines serve the weights of the last committed step
        return t

    def rl_step(t, k):  # the driver's step k: update + checkpoint (trainer), publish
        t.train_step([dict(s, weight_version=k - 1) for s in samples], k)
        t.mark_published(k)

    ref = trainer(tmp_path / "ref", 0)  # steps 1 and 2 without a kill
    rl_step(ref, 1)
    rl_step(ref, 2)
    run = tmp_path / "run"
    killed = trainer(run, 0)
    rl_step(killed, 1)
    state = {"phase_times": {}, "step": 1, "critic_warmup": {}}
    (run / "state.json").write_text(json.dumps(state))  # step 1 committed
    rundir.prune_previous(run)
    rl_step(killed, 2)  # step 2 checkpointed, then the kill: state.json still says step 1
    latest, previous = run / "ckpt" / "latest", run / "ckpt" / "previous"
    assert rundir.checkpoint_step(latest) == 2 and rundir.checkpoint_step(previous) == 1
    with pytest.raises(ValueError, match="holds RL step 2, state.json committed step 1"):
        TR.Trainer(dataclasses.replace(ARGS, run_dir=str(run)), sft, 1)  # loading it would apply step 2 twice
    notes = rundir.resume_run(run, rundir.load_state(run), sft_done=True)
    assert any("discarded the checkpoint of step 2" in n for n in notes), notes
    assert rundir.checkpoint_step(latest) == 1 and not previous.exists()
    resumed = trainer(run, 1)
    rl_step(resumed, 2)
    want, got = ref.state_dicts(), resumed.state_dicts()
    for part in ("actor", "critic"):
        for k, v in want[part].items():
            assert torch.equal(got[part][k], v), (part, k)  # step 2 applied exactly once: bitwise the same weights


def test_a_resume_runs_at_the_flags_learning_rates_not_the_checkpoints(tmp_path, tiny_sft):
    """Adam's load_state_dict brings back the lr it was saved with: a resume with another --actor-lr / --critic-lr
    kept the old one without a word. The flags win, and the change is in log.txt."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    t = TR.Trainer(dataclasses.replace(ARGS, run_dir=str(run)), str(tiny_sft.sft), 0)
    t.mark_published(0)
    t.train_step([dict(s, weight_version=0) for s in tiny_sft.samples], 1)
    (run / "state.json").write_text(json.dumps({"phase_times": {}, "step": 1, "critic_warmup": {}}))
    same = TR.Trainer(dataclasses.replace(ARGS, run_dir=str(run)), str(tiny_sft.sft), 1)
    assert (TR.optimizer_lr(same.actor_opt), TR.optimizer_lr(same.critic_opt)) == (1e-3, 1e-3)
    assert "from here it runs at" not in (run / "log.txt").read_text()
    new = TR.Trainer(dataclasses.replace(ARGS, run_dir=str(run), actor_lr=3e-4, critic_lr=2e-3), str(tiny_sft.sft), 1)
    assert new.actor_opt.param_groups[0]["lr"] == 3e-4 and new.critic_opt.param_groups[0]["lr"] == 2e-3
    assert new.actor_opt.state_dict()["state"]  # the moments were loaded: only the lr changed
    log = (run / "log.txt").read_text()
    assert "--actor-lr 0.0003: the loaded optimizer ran at 0.001, from here it runs at 0.0003" in log
    assert "--critic-lr 0.002: the loaded optimizer ran at 0.001" in log


def test_kill_between_checkpoint_renames_puts_the_committed_one_back(tmp_path):
    ck = tmp_path / "ckpt"
    fake_ckpt(ck / "previous", 1)  # latest renamed to previous, the new one not yet renamed to latest
    fake_ckpt(ck / "latest.tmp", 2)
    notes = rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)
    assert rundir.checkpoint_step(ck / "latest") == 1 and sorted(p.name for p in ck.iterdir()) == ["latest"]
    assert any("put back from ckpt/previous" in n for n in notes)
    fake_ckpt(ck / "latest.tmp", None)  # killed while writing: no step.json
    rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)
    assert sorted(p.name for p in ck.iterdir()) == ["latest"]


def test_first_step_checkpoint_without_commit_is_discarded(tmp_path):
    fake_ckpt(tmp_path / "ckpt" / "latest", 1)
    notes = rundir.resume_run(tmp_path, {"phase_times": {}, "step": 0, "critic_warmup": {}}, sft_done=True)
    assert not (tmp_path / "ckpt" / "latest").exists() and "step 1" in notes[0]


def test_committed_step_keeps_latest_and_prunes_previous(tmp_path):
    fake_ckpt(tmp_path / "ckpt" / "latest", 2)
    fake_ckpt(tmp_path / "ckpt" / "previous", 1)  # killed after the commit, before prune_previous
    notes = rundir.resume_run(tmp_path, {"phase_times": {}, "step": 2, "critic_warmup": {}}, sft_done=True)
    assert notes == [] and rundir.checkpoint_step(tmp_path / "ckpt" / "latest") == 2
    assert not (tmp_path / "ckpt" / "previous").exists()


def test_committed_step_without_its_checkpoint_is_refused(tmp_path):
    fake_ckpt(tmp_path / "ckpt" / "latest", 2)
    with pytest.raises(ValueError, match=r"state\.json: committed RL step 3, but no checkpoint of that step"):
        rundir.resume_run(tmp_path, {"phase_times": {}, "step": 3, "critic_warmup": {}}, sft_done=True)


def test_run_dir_with_checkpoints_but_no_state_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "ckpt" / "sft").mkdir(parents=True)
    (run / "ckpt" / "sft" / "config.json").write_text("{}")
    write_jsonl(run / "metrics.jsonl", [{"phase": "sft", "step": 1, "sft_loss": 3.0}])
    with pytest.raises(ValueError, match="holds ckpt, metrics.jsonl but no state.json"):
        T.train(dataclasses.replace(T.QUICK, run_dir=str(run)))
    assert not (run / "state.json").exists() and not (run / "args.json").exists()  # nothing started over it
    assert rows(run / "metrics.jsonl") == [{"phase": "sft", "step": 1, "sft_loss": 3.0}]
    assert rundir.load_state(tmp_path / "fresh") == {"phase_times": {}, "step": 0}


def test_torn_last_metrics_line_is_dropped_with_a_note(tmp_path):
    good = [{"phase": "sft", "step": 1, "sft_loss": 2.0}, {"phase": "rl", "step": 1, "reward_mean": 0.1}]
    write_jsonl(tmp_path / "metrics.jsonl", good, tail='{"phase": "rl", "step": 2, "rew')
    fake_ckpt(tmp_path / "ckpt" / "latest", 1)
    notes = rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)
    assert rows(tmp_path / "metrics.jsonl") == good and notes == ["metrics.jsonl: dropped a torn last line "
                                                                  "(31 chars: a kill mid-write)"]
    write_jsonl(tmp_path / "metrics.jsonl", good[:1], tail=json.dumps(good[1]))  # killed before its newline
    rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n") and rows(tmp_path / "metrics.jsonl") == good
    write_jsonl(tmp_path / "metrics.jsonl", good[:1], tail="{not json\n" + json.dumps(good[1]) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not JSON"):
        rundir.rewrite_jsonl(tmp_path / "metrics.jsonl", lambda r: True)
    write_jsonl(tmp_path / "metrics.jsonl", [{"phase": "rl", "step": "2"}])
    with pytest.raises(ValueError, match=r"metrics.jsonl: an RL row without an integer step \('2'\)"):
        rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)


def test_corrupt_state_and_checkpoint_files_are_named(tmp_path):
    (tmp_path / "state.json").write_text('{"step": 3, "phase_ti')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "state.json")) + ": corrupt"):
        rundir.load_state(tmp_path)
    (tmp_path / "state.json").write_text('{"step": "3", "phase_times": {}}')
    with pytest.raises(ValueError, match="state.json: corrupt: expected an object with an integer 'step'"):
        rundir.load_state(tmp_path)
    (tmp_path / "trainer.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "trainer.pt")) + ": corrupt or unreadable"):
        rundir.load_trainer_file(tmp_path / "trainer.pt")
    latest = fake_ckpt(tmp_path / "ckpt" / "latest", 1)
    (latest / "step.json").write_text("{")
    with pytest.raises(ValueError, match="latest/step.json: corrupt checkpoint marker"):
        rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)
    (latest / "step.json").write_text('{"step": 1}')
    data = (latest / "model.safetensors").read_bytes()
    (latest / "model.safetensors").write_bytes(data[: len(data) // 2])  # killed mid-copy / disk full
    with pytest.raises(ValueError, match="latest/model.safetensors: corrupt weights file"):
        rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)


def test_unfinished_sft_and_warmup_leave_no_rows_to_duplicate(tmp_path):
    sft_rows = [{"phase": "sft", "step": i, "sft_loss": 1.0 / i} for i in (1, 2, 3)]
    write_jsonl(tmp_path / "metrics.jsonl", sft_rows)
    (tmp_path / "ckpt" / "sft.tmp").mkdir(parents=True)  # killed while saving the SFT checkpoint
    rundir.resume_run(tmp_path, {"phase_times": {}, "step": 0}, sft_done=False)  # SFT is redone from its start
    assert rows(tmp_path / "metrics.jsonl") == [] and not (tmp_path / "ckpt" / "sft.tmp").exists()
    # SFT done, warm-up killed after its critic file and rows, before state.json recorded it
    warm = [{"phase": "critic_warmup", "step": i, "explained_variance": 0.1} for i in (1, 2)]
    write_jsonl(tmp_path / "metrics.jsonl", sft_rows + warm)
    write_jsonl(tmp_path / "failed_trials.jsonl", [{"tag": "sft", "task": "a", "reason": "x"},
                                                   {"tag": "warmup", "task": "b", "reason": "y"}])
    torch.save({"critic": {}}, tmp_path / "ckpt" / "critic_warm.pt")
    notes = rundir.resume_run(tmp_path, {"phase_times": {}, "step": 0}, sft_done=True)
    assert rows(tmp_path / "metrics.jsonl") == sft_rows and not (tmp_path / "ckpt" / "critic_warm.pt").exists()
    assert [r["tag"] for r in rows(tmp_path / "failed_trials.jsonl")] == ["sft"]
    assert any("critic warm-up was never committed" in n for n in notes)


def test_uncommitted_rl_step_rows_and_samples_are_dropped(tmp_path):
    fake_ckpt(tmp_path / "ckpt" / "latest", 2)
    fake_ckpt(tmp_path / "ckpt" / "previous", 1)
    rl = [{"phase": "rl", "step": k, "reward_mean": 0.0} for k in (1, 2)]
    write_jsonl(tmp_path / "metrics.jsonl", rl)
    write_jsonl(tmp_path / "dropped.jsonl", [{"step": 1, "task": "a"}, {"step": 2, "task": "b"}])
    write_jsonl(tmp_path / "failed_trials.jsonl", [{"tag": "step1", "task": "a", "reason": "x"},
                                                   {"tag": "step2", "task": "b", "reason": "y"}])
    (tmp_path / "samples").mkdir()
    for k in (1, 2):
        (tmp_path / "samples" / f"step_{k:06d}.jsonl").write_text("")
    rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)
    assert rows(tmp_path / "metrics.jsonl") == rl[:1]
    assert rows(tmp_path / "dropped.jsonl") == [{"step": 1, "task": "a"}]
    assert [r["tag"] for r in rows(tmp_path / "failed_trials.jsonl")] == ["step1"]
    assert [p.name for p in (tmp_path / "samples").iterdir()] == ["step_000001.jsonl"]
    assert rundir.checkpoint_step(tmp_path / "ckpt" / "latest") == 1


@pytest.mark.parametrize("evidence", ["ckpt", "metrics", "samples"])
def test_rolled_back_state_is_refused_and_nothing_is_deleted(tmp_path, evidence):
    """A crash leaves at most one step uncommitted: a state.json at step 0 beside work of step 5 was rolled back
    or replaced. Resume refuses, naming the evidence, and deletes nothing (it used to delete the checkpoint and the
    five metrics rows with one log line)."""
    if evidence == "ckpt":
        fake_ckpt(tmp_path / "ckpt" / "latest", 5)
    elif evidence == "metrics":
        write_jsonl(tmp_path / "metrics.jsonl", [{"phase": "rl", "step": k} for k in range(1, 6)])
    else:
        (tmp_path / "samples").mkdir()
        (tmp_path / "samples" / "step_000005.jsonl").write_text("")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    metrics = (tmp_path / "metrics.jsonl").read_text() if evidence == "metrics" else None
    with pytest.raises(ValueError, match=r"commits RL step 0, but the run directory holds work of later steps: .*"
                                         r"rolled back or replaced"):
        rundir.resume_run(tmp_path, {"phase_times": {}, "step": 0, "critic_warmup": {}}, sft_done=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    if metrics is not None:
        assert (tmp_path / "metrics.jsonl").read_text() == metrics


def test_work_one_step_ahead_is_a_crash_and_is_redone(tmp_path):
    """The boundary: step 2's checkpoint, samples and metrics row beside a state at step 1 (a kill before the
    commit) are discarded and redone, not refused."""
    fake_ckpt(tmp_path / "ckpt" / "latest", 2)
    fake_ckpt(tmp_path / "ckpt" / "previous", 1)
    write_jsonl(tmp_path / "metrics.jsonl", [{"phase": "rl", "step": k} for k in (1, 2)])
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step_000002.jsonl").write_text("")
    rundir.resume_run(tmp_path, {"phase_times": {}, "step": 1, "critic_warmup": {}}, sft_done=True)
    assert rundir.checkpoint_step(tmp_path / "ckpt" / "latest") == 1 and rows(tmp_path / "metrics.jsonl") == [
        {"phase": "rl", "step": 1}]
