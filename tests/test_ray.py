"""The Ray layout (infra.py) with rollout.py's Ray pieces: rollout-worker actors keep the first finishers and
cancel the rest, rounds are independent, and the engine actor takes the publish barrier (pause, load weights of
version v, resume)."""
import os
import shutil
import subprocess
import time

import pytest

import infra
import model
import rollout
from engine.server import EngineActor
from engine import client as client_lib
from test_rollout import SCRIPT, make_task

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"),
                                reason="the bubblewrap sandbox needs root and bwrap")


WORKER_VARS = ("PYTHONPATH", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")


@pytest.fixture(scope="module")
def layout():
    infra.ray_stop([])  # a cluster of this module's own (another module may have left one: ray_start joins it)
    before = {k: os.environ.get(k) for k in WORKER_VARS}
    ray = infra.ray_start(1 + 1 + 2)
    pgs, place = infra.ray_layout(1, 2)
    yield ray, place, before
    infra.ray_stop(pgs)


def test_a_started_cluster_gives_the_workers_their_variables_through_the_raylet(layout):
    """infra.ray_start on this machine: the workers get PYTHONPATH (the repository first) and OMP_NUM_THREADS from
    the raylet's environment, with no runtime_env; this process's own variables are put back."""
    ray, _, before = layout
    assert {k: os.environ.get(k) for k in WORKER_VARS} == before
    env = ray.get(ray.remote(lambda: dict(os.environ)).options(num_cpus=0).remote())
    assert env["OMP_NUM_THREADS"] == "2" and env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.path.dirname(os.path.abspath(infra.__file__))
    assert not dict(ray.get_runtime_context().runtime_env)


def test_workers_keep_first_finished_cancel_rest_and_rounds_are_independent(tmp_path, layout):
    ray, place, _ = layout
    workers = rollout.ray_rollout_workers(2, 2, None, place["workers"])
    pids = ray.get([w.pid.remote() for w in workers])
    assert len(set(pids)) == 2 and os.getpid() not in pids  # two actor processes
    fast = [make_task(tmp_path, f"fast{i}") for i in range(3)]
    slow = make_task(tmp_path, "slow", solve="sleep 60")
    t0 = time.time()
    kept, dropped = rollout.ray_run_trials(workers, [slow] + fast, "oracle", n_keep=3)
    assert sorted(r["task"] for r in kept) == ["fast0", "fast1", "fast2"] and all(r["resolved"] for r in kept)
    assert [d["task"] for d in dropped] == ["slow"] and dropped[0]["reason"] == "cancelled"
    assert dropped[0]["seconds"] < 30 and time.time() - t0 < 40
    assert subprocess.run(["pgrep", "-f", f"bwrap.*{tmp_path}"], capture_output=True).returncode == 1  # jail killed
    # the next round on the same actors is not touched by the previous round's cancel
    kept, dropped = rollout.ray_run_trials(workers, fast, "nop", n_keep=None)
    assert len(kept) == 3 and not dropped and all(r["exit_reason"] == "nop" for r in kept)
    for w in workers:
        ray.kill(w)


def test_engine_actor_publish_barrier_sets_weight_version(tmp_path, layout):
    ray, place, _ = layout
    tok = model.train_tokenizer([str(r) for r in SCRIPT] * 4, vocab_size=300)
    path = tmp_path / "ckpt"
    model.save_checkpoint(model.build_actor(model.tiny_config(len(tok)), seed=0), tok, str(path))
    engine = ray.remote(EngineActor).options(**place["engines"][0]).remote(str(path), "fp32")
    info = ray.get(engine.info.remote())
    assert info["pid"] != os.getpid()
    client = client_lib.EngineClient(info["url"])
    before = client.generate(tok.encode("hello", add_special_tokens=False), {"max_new_tokens": 4, "temperature": 0})
    client_lib.publish_from_disk([info["url"]], path, 7)
    assert client.model_info()["weight_version"] == "7"
    after = client.generate(tok.encode("hello", add_special_tokens=False), {"max_new_tokens": 4, "temperature": 0})
    assert after["weight_version"] == "7" and before["weight_version"] == "0"
    assert after["output_ids"] == before["output_ids"]  # same weights reloaded: same greedy tokens
    ray.get(engine.stop.remote())
    ray.kill(engine)
