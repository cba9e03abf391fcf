"""What the test files share: the repo on sys.path, two torch threads that sleep when they wait, one task cache per
run of the suite (T1_TASK_CACHE), the workers' order (tests/suite_order.py), and the tiny trainer fixture (an SFT
checkpoint of the tiny actor and fake TITO samples it recorded) of tests/test_trainer_group.py and
tests/test_resume.py, built once per session."""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

# The suite is the CPU suite (what CI runs): on a GPU node it hides the GPU, since the Megatron tests build their models
# with CPU initialisation and Megatron moves parts of them to a visible GPU (the first GPU run, 2026-12-04: test_mcore
# failed on devices); T1_TEST_GPU=1 keeps it for the tests that need one (test_mcore_te's TE spec: cluster.gpu_check).
if os.environ.get("T1_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# OpenMP threads that wait sleep instead of spinning (read as torch loads libgomp; inherited by every subprocess and
# Ray actor): two workers of two torch threads each on 2 cores spun away a share of the CPU; test_update + test_mcore_tp
# twice side by side took 74-81 s passive against 100-113 s spinning (2026-12-07). A value set before pytest is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)
torch._dynamo.config.fail_on_recompile_limit_hit = True

import model as M  # noqa: E402
import r3  # noqa: E402
import suite_order  # noqa: E402

_recorder = suite_order.Recorder()


def pytest_configure(config):
    config.addinivalue_line("markers", f"{suite_order.WAITS}: the module's tests mostly wait (tests/suite_order.py)")
    config.addinivalue_line("markers", f"{suite_order.RANKS}: the module's tests run on tests/gloo_pool.py's kept "
                            "ranks (tests/suite_order.py)")
    config.addinivalue_line("markers", f"{suite_order.CORES}: the module's tests keep both cores busy "
                            "(tests/suite_order.py)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks order() adds
def pytest_collection_modifyitems(config, items):
    """The workers' order: longest first, modules with costly fixtures whole (tests/suite_order.py)."""
    items[:] = suite_order.order(items, suite_order.load())


_last_module = [None]


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures are set up (a module fixture may compile)
def pytest_runtest_setup(item):
    """Each test module starts with torch.compile's caches empty, as in the fresh processes its results are compared
    with. Megatron compiled its fused functions (jit_fuser = torch.compile; on CPU they now run eager:
    cluster/mcore_cpu.init_cpu); in a worker that ran other modules' models (other dtypes, shapes) a function hit
    dynamo's limit of 8 variants and ran eager, and an in-process reference then differed from the spawned ranks
    (compiled): CI, 2026-12-06, test_cp_megatron / test_mcore_optim bf16. Kept for any compiled function: reaching the
    limit is an error here (fail_on_recompile_limit_hit), not a silent change of numerics."""
    if getattr(item.config.option, "loadgroup", False):  # a worker under --dist loadgroup: xdist saw the groups
        suite_order.check_groups([item])  # (an exception at collection reaches the controller only as "no workers")
    module = item.nodeid.split("::", 1)[0]
    if module != _last_module[0]:
        _last_module[0] = module
        torch._dynamo.reset()


def pytest_runtest_logreport(report):
    _recorder.add(report)


def pytest_sessionfinish(session):
    """With T1_TEST_DURATIONS=PATH, the controller (or a run without workers) writes the measured costs there."""
    out = os.environ.get("T1_TEST_DURATIONS")
    if out and not hasattr(session.config, "workerinput"):
        _recorder.write(Path(out))

N_SAMPLES = 7  # minibatches of 3, 3, 1: uneven shares, and a rank with no row in the last one


def fake_samples(actor, vocab: int) -> list[dict]:
    """Valid TITO-like samples: random tokens, loss on two 'turns', experts recorded by the actor (R3 replay)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(N_SAMPLES):
        n = 20 + 3 * i
        tokens = torch.randint(3, vocab, (n,), generator=g)
        mask = np.zeros(n, dtype=np.int8)
        mask[6:11] = mask[14:] = 1  # two model replies with tool output between
        with r3.routing(actor, "record") as rec, torch.no_grad():
            actor(input_ids=tokens[None])
        samples.append({"tokens": tokens.numpy(), "loss_mask": mask,
                        "rollout_logprobs": (-torch.rand(n, generator=g) * torch.from_numpy(mask)).double().numpy(),
                        "routed_experts": rec.experts[0, : n - 1].numpy(), "reward": (i % 4) / 20, "passed": i % 4,
                        "total": 4, "reward_source": "ctrf", "weight_version": 0, "turns": 2})
    return samples


@pytest.fixture(scope="session", autouse=True)
def task_cache(tmp_path_factory):
    """T1_TASK_CACHE for the whole run, in a folder every xdist worker of this run shares (the workers' base temp
    folders sit in the run's): a pool generated with the same arguments by one test (train_t1 in process or in a
    subprocess: they inherit the variable) is copied by the next (data.generate_tasks, tasks/pool_cache.py). A value
    set before pytest is kept. tests/test_data.py unsets it: the generator's own tests generate."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ.setdefault("T1_TASK_CACHE", str(root / "task_cache"))
    return os.environ["T1_TASK_CACHE"]


@pytest.fixture(scope="session")
def tiny_sft(tmp_path_factory):
    """-> (sft: the tiny actor's checkpoint dir, samples: fake_samples of that actor); read only."""
    tmp_path = tmp_path_factory.mktemp("tiny_sft")
    tok = M.train_tokenizer(["ls -la /app\n", "cat notes.txt | wc -l\n"] * 20, vocab_size=300)
    actor = M.build_actor(M.tiny_config(len(tok)), seed=0)
    M.save_checkpoint(actor, tok, tmp_path / "sft")
    return SimpleNamespace(sft=tmp_path / "sft", samples=fake_samples(actor, len(tok)))


@pytest.fixture(scope="module")
def tok():
    """The tokenizer of tests/test_model.py and tests/test_engine.py (trained on test_model.TEXTS)."""
    from test_model import TEXTS
    return M.train_tokenizer(TEXTS, vocab_size=400)


@pytest.fixture(scope="module")
def ckpt(tok, tmp_path_factory):
    """A tiny random actor's HF checkpoint with `tok` (the engine's and the model tests' weights)."""
    path = str(tmp_path_factory.mktemp("ckpt") / "actor")
    M.save_checkpoint(M.build_actor(M.tiny_config(len(tok)), seed=0), tok, path)
    return path
