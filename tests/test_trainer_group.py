"""trainer.TrainerGroup: critic warm-up + one train_step over 2 data-parallel Ray ranks (gloo) equal the
1-rank ones (weights within 1e-5 at lr 1e-4; the replicas bitwise identical), then a step on one sample
(rank 1 holds none and still joins every gradient sum); the same under Megatron model-parallel plans. The
tiny actor's checkpoint and its fake samples: conftest.tiny_sft."""
import dataclasses
import shutil
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

import infra
import train_t1 as T
import trainer as TR

pytestmark = pytest.mark.cores  # Ray trainer ranks: both cores busy (tests/suite_order.py runs it beside the waits)


def test_two_rank_step_equals_one_rank_step(tmp_path, tiny_sft):
    sft, samples = tiny_sft.sft, tiny_sft.samples
    base = dataclasses.replace(T.EMBEDDED, minibatch_size=3, ppo_epochs=2, actor_lr=1e-4, critic_lr=1e-4,
                               torch_threads=1)

    (tmp_path / "one" / "ckpt").mkdir(parents=True)
    one = TR.Trainer(dataclasses.replace(base, run_dir=str(tmp_path / "one")), str(sft), 0)
    before = {k: v.clone() for k, v in one.actor.state_dict().items()}
    warm1 = one.warmup(samples)
    one.mark_published(0)
    stats1 = one.train_step(samples, 1)
    one.train_step(samples[:1], 2)  # fewer samples than ranks: rank 1 has none
    ref = one.state_dicts()

    ray = infra.ray_start(2, "", 1)
    try:
        (tmp_path / "two" / "ckpt").mkdir(parents=True)
        two_args = dataclasses.replace(base, run_dir=str(tmp_path / "two"), trainer_ranks=2)
        group = TR.TrainerGroup(ray, two_args, str(sft), 0, [{"num_cpus": 1}] * 2)
        warm2 = ray.get(group.warmup.remote(samples))  # the loop's calls: fan out, rank 0's answer
        ray.get(group.mark_published.remote(0))
        stats2 = ray.get(group.train_step.remote(samples, 1))
        ray.get(group.train_step.remote(samples[:1], 2))
        reps = ray.get([r.state_dicts.remote() for r in group.ranks])
        ray.get(group.close.remote())
    finally:
        ray.shutdown()

    for part in ("actor", "critic"):
        for k, v in ref[part].items():  # the 2 replicas: bitwise identical
            assert torch.equal(reps[0][part][k], reps[1][part][k]), f"{part}.{k}: replicas differ"
        diff = max((reps[0][part][k] - v).abs().max().item() for k, v in ref[part].items())
        print(f"{part}: max |2 ranks - 1 rank| = {diff:.2e}")
        assert diff < 1e-5, f"{part}: 2-rank step differs from the 1-rank step by {diff}"
    moved = max((ref["actor"][k] - v).abs().max().item() for k, v in before.items())
    print(f"largest actor change (2 steps): {moved:.2e}")
    assert moved > 1e-4  # the step did change the weights (the comparison above is not vacuous)
    for k in ("pg_loss", "approx_kl", "clipfrac", "value_loss", "value_clipfrac", "explained_variance", "dlogp",
              "dlogp_r3_off"):
        assert stats2[k] == pytest.approx(stats1[k], rel=1e-4, abs=1e-6), k
    for r1, r2 in zip(warm1, warm2):
        assert r2 == pytest.approx(r1, rel=1e-4, abs=1e-6, nan_ok=True)  # EV nan: constant returns
    assert (tmp_path / "two" / "ckpt" / "latest" / "trainer.pt").exists()  # rank 0 saved the checkpoint


@pytest.fixture(scope="module")
def megatron_one_rank(tmp_path_factory, tiny_sft):
    """The one-rank Megatron trainer (torch Adam) after critic warm-up and two train_steps: the reference every
    plan is held to (computed once for the module)."""
    tmp_path = tmp_path_factory.mktemp("megatron")
    samples = tiny_sft.samples
    base = dataclasses.replace(T.EMBEDDED, backend="megatron", minibatch_size=3, ppo_epochs=2, actor_lr=1e-4,
                               critic_lr=1e-4, torch_threads=1)
    (tmp_path / "one" / "ckpt").mkdir(parents=True)
    one = TR.Trainer(dataclasses.replace(base, run_dir=str(tmp_path / "one")), str(tiny_sft.sft), 0)
    before = {k: v.clone() for k, v in one.state_dicts()["actor"].items()}
    warm1 = one.warmup(samples)
    one.mark_published(0)
    stats1 = one.train_step(samples, 1)
    one.train_step(samples[:1], 2)
    return SimpleNamespace(sft=tiny_sft.sft, samples=samples, base=base, before=before, warm1=warm1,
                           stats1=stats1, ref=one.state_dicts())


# {"tp": 2} alone is covered by the TP x PP x EP plan here and end to end in tests/test_e2e.py; cp with pp is
# refused (test_bad_plans_are_refused_naming_the_flag): two 4-rank plans cover every axis
PLANS = ['{"tp": 2, "pp": 2, "etp": 1, "ep": 2}', '{"cp": 2, "dp": 2, "ep": 2}']
WORLD = 4


@pytest.fixture(scope="module")
def megatron_plans(tmp_path_factory, megatron_one_rank):
    """Both plans' 4-rank groups in one Ray session, side by side: each group gets all of its calls at once (Ray
    runs one caller's calls to an actor in order), so that one group's waits overlap the other's work -> {plan:
    what test_megatron_model_parallel_step_equals_one_rank checks}."""
    o = megatron_one_rank
    ray = infra.ray_start(WORLD * len(PLANS), "", 1)
    try:
        runs = {}
        for i, plan in enumerate(PLANS):
            run_dir = tmp_path_factory.mktemp(f"plan{i}") / "two"
            (run_dir / "ckpt").mkdir(parents=True)
            args = dataclasses.replace(o.base, run_dir=str(run_dir), plan=plan)
            T.check_args(args)
            runs[plan] = dict(run_dir=run_dir, world=TR.parallel_plan(args)["world"], args=args)
        with ThreadPoolExecutor(len(PLANS)) as pool:  # the groups' ranks start together (each group waits on its own)
            groups = pool.map(lambda r: TR.TrainerGroup(ray, r["args"], str(o.sft), 0, [{"num_cpus": 1}] * WORLD),
                              runs.values())
            for r, group in zip(runs.values(), groups):
                r["group"] = group
        for r in runs.values():
            g = r["group"]
            r["warm2"] = g.warmup.remote(o.samples)
            g.mark_published.remote(0)
            r["stats2"] = g.train_step.remote(o.samples, 1)
            g.train_step.remote(o.samples[:1], 2)
            r["reps"] = [x.state_dicts.remote() for x in g.ranks]  # gathered: a collective on every rank
            r["to0"] = [x.state_dicts.remote(to_rank0=True) for x in g.ranks]  # as save and publish gather
            r["numel"] = [x.optimizer_state_numel.remote() for x in g.ranks]
            r["close"] = g.close.remote()
        out = {}
        for plan, r in runs.items():
            out[plan] = SimpleNamespace(run_dir=r["run_dir"], world=r["world"], warm2=ray.get(r["warm2"]),
                                        stats2=ray.get(r["stats2"]), reps=ray.get(r["reps"]), to0=ray.get(r["to0"]),
                                        numel=ray.get(r["numel"]))
            ray.get(r["close"])
    finally:
        ray.shutdown()
    return out


@pytest.mark.parametrize("plan", PLANS)
def test_megatron_model_parallel_step_equals_one_rank(megatron_one_rank, megatron_plans, plan):
    """--backend megatron --plan over 4 Ray ranks (parallel_state per plan: TP = 2 with sequence parallel x 2
    pipeline stages, EP = 2 over the TP ranks with expert TP 1; 2 context-parallel x 2 data-parallel ranks with
    EP = 2 over them; Megatron DDP + mcore_parallel.ShardedAdam, the distributed optimizer): critic warm-up and two
    train_steps (the second on one sample: another DP rank trains a dummy row) give the weights of the one-rank
    Megatron trainer (torch Adam), gathered back to TP = EP = PP = 1 (on every rank, and to rank 0 alone as save and
    publish do); rank 0 writes the HF checkpoint and every rank its shard file."""
    o, p = megatron_one_rank, megatron_plans[plan]
    ref, before, warm1, stats1 = o.ref, o.before, o.warm1, o.stats1
    world, reps, to0, warm2, stats2 = p.world, p.reps, p.to0, p.warm2, p.stats2
    assert world == WORLD
    for part in ("actor", "critic"):
        assert [r[part] is None for r in to0] == [False] + [True] * (world - 1)
        assert to0[0][part].keys() == ref[part].keys()
        assert all(torch.equal(to0[0][part][k], reps[0][part][k]) for k in ref[part]), part
        assert reps[0][part].keys() == ref[part].keys()
        for k in ref[part]:
            for r in range(1, world):
                assert torch.equal(reps[0][part][k], reps[r][part][k]), f"{part}.{k}: ranks gathered different weights"
        diff = max((reps[0][part][k] - v).abs().max().item() for k, v in ref[part].items())
        print(f"{plan} {part}: max |{world} ranks - 1 rank| = {diff:.2e}")
        assert diff < 1e-5, f"{part}: {plan} step differs from the 1-rank step by {diff}"
    moved = max((ref["actor"][k] - v).abs().max().item() for k, v in before.items())
    assert moved > 1e-4
    for k in ("pg_loss", "approx_kl", "clipfrac", "value_loss", "value_clipfrac", "explained_variance", "dlogp",
              "dlogp_r3_off", "expert_set_mismatch"):
        assert stats2[k] == pytest.approx(stats1[k], rel=1e-4, abs=1e-6), k
    for r1, r2 in zip(warm1, warm2):
        assert r2 == pytest.approx(r1, rel=1e-4, abs=1e-6, nan_ok=True)
    p_expert = sum(v.numel() for k, v in ref["actor"].items() if ".local_experts." in k)
    for n in p.numel:  # Proposition 7.1 on the real optimizer: expert Adam state P_expert / W on each of W = 4 ranks
        print(f"{plan} Adam state per moment: experts {n['expert']} (P_expert / {world} = {p_expert // world}), "
              f"dense {n['dense']}")
        assert n["expert"] == p_expert // world
    latest = p.run_dir / "ckpt" / "latest"
    assert (latest / "config.json").exists()  # rank 0 wrote the gathered HF actor
    assert {f.name for f in latest.glob("trainer_rank*.pt")} == {f"trainer_rank{r}.pt" for r in range(world)}


@pytest.mark.parametrize("flags, error, match", [
    (["--plan", '{"tp": 2}'], ValueError, "hf backend only runs full replicas"),
    (["--backend", "megatron", "--plan", '{"cp": 2, "pp": 2}'], NotImplementedError, "cp = 2 with pp = 2"),
    (["--backend", "megatron", "--plan", '{"ep": 4, "dp": 2}'], ValueError, "must divide"),
    (["--backend", "megatron", "--plan", '{"tp": 2}', "--trainer-ranks", "3"], ValueError, "--trainer-ranks"),
    (["--backend", "megatron", "--plan", "tp=2"], ValueError, "expected JSON"),
    (["--backend", "megatron", "--plan", '{"tp": 0}'], ValueError, ">= 1")])
def test_bad_plans_are_refused_naming_the_flag(flags, error, match):
    with pytest.raises(error, match=match):
        T.check_args(T.parse_args(["--quick"] + flags))


def test_plan_sets_the_trainer_ranks():
    assert TR.parallel_plan(T.parse_args(["--quick", "--trainer-ranks", "3"]))["world"] == 3  # replicas: dp = 3
    p = TR.parallel_plan(T.parse_args(["--quick", "--backend", "megatron", "--plan", '{"tp": 2, "ep": 2, "dp": 2}']))
    assert (p["world"], p["etp"]) == (4, 2)


def test_megatron_bf16_trainer_over_two_ranks_resumes_exactly(tmp_path, megatron_one_rank):
    """--param-dtype bf16 (the cluster presets' precision) with --plan dp 2 x ep 2 on 2 Ray ranks: Megatron DDP with
    fp32 grads + ShardedAdam with fp32 master shards. Critic warm-up and two train_steps land near the fp32 one-rank
    trainer (bf16 rounding: measured max |bf16 - fp32| below; asserted < 0.02 on weights of magnitude ~0.1-1, which a
    missing or doubled update at lr 1e-4 would not explain either way, so it is the moved-check below that makes
    the step count); the parameters stay bf16 and the HF checkpoint is written in bf16; a group resumed from that
    checkpoint (bf16 weights + each rank's fp32 masters and moments) holds exactly the same weights and takes the
    same next step bitwise."""
    o = megatron_one_rank
    args = dataclasses.replace(o.base, run_dir=str(tmp_path / "run"), plan='{"dp": 2, "ep": 2}', param_dtype="bf16")
    T.check_args(args)
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    ray = infra.ray_start(2, "", 1)
    try:
        group = TR.TrainerGroup(ray, args, str(o.sft), 0, [{"num_cpus": 1}] * 2)
        ray.get(group.warmup.remote(o.samples))
        ray.get(group.mark_published.remote(0))
        ray.get(group.train_step.remote(o.samples, 1))
        ray.get(group.train_step.remote(o.samples[:1], 2))
        after2 = ray.get([r.state_dicts.remote() for r in group.ranks])[0]
        shutil.copytree(tmp_path / "run" / "ckpt", tmp_path / "resumed" / "ckpt")  # the run as a kill would leave it
        ray.get(group.mark_published.remote(0))  # the samples' version 0 = the step-2 weights, as the resumed run
        ray.get(group.train_step.remote(o.samples, 3))
        after3 = ray.get([r.state_dicts.remote() for r in group.ranks])[0]
        ray.get(group.close.remote())
        for r in group.ranks:  # their CPUs for the resumed group's ranks
            ray.kill(r)
        resumed = TR.TrainerGroup(ray, dataclasses.replace(args, run_dir=str(tmp_path / "resumed")), str(o.sft), 2,
                                   [{"num_cpus": 1}] * 2)  # from ckpt/latest = step 2
        back2 = ray.get([r.state_dicts.remote() for r in resumed.ranks])[0]
        ray.get(resumed.mark_published.remote(0))
        ray.get(resumed.train_step.remote(o.samples, 3))
        back3 = ray.get([r.state_dicts.remote() for r in resumed.ranks])[0]
        ray.get(resumed.close.remote())
    finally:
        ray.shutdown()
    for part in ("actor", "critic"):
        assert all(v.dtype == torch.bfloat16 for k, v in after2[part].items() if v.is_floating_point()), part
        diff = max((after2[part][k].float() - v).abs().max().item() for k, v in o.ref[part].items())
        print(f"bf16 {part}: max |bf16 2 ranks - fp32 1 rank| after 2 steps = {diff:.2e}")
        assert diff < 0.02
        bad = {k: (back2[part][k].float() - after2[part][k].float()).abs().max().item() for k in after2[part]
               if not torch.equal(back2[part][k], after2[part][k])}
        assert not bad, f"{part}: resumed weights differ: {bad}"
        assert all(torch.equal(back3[part][k], after3[part][k]) for k in after3[part]), f"{part}: resumed step"
    moved = max((after3["actor"][k].float() - after2["actor"][k].float()).abs().max().item() for k in after2["actor"])
    assert moved > 0  # step 3 changed the bf16 weights (the bitwise comparison is not vacuous)
    resumed_latest = tmp_path / "resumed" / "ckpt" / "latest"  # as one rank's file, for a one-rank fp32 trainer:
    shutil.copy(resumed_latest / "trainer_rank0.pt", resumed_latest / "trainer.pt")  # refused by name
    with pytest.raises(ValueError, match="--param-dtype: .* was trained with bf16, this run asks for fp32"):
        TR.Trainer(dataclasses.replace(args, run_dir=str(tmp_path / "resumed"), param_dtype="fp32", plan=""),
                    str(o.sft), 3)  # the resumed group's step 3
    latest = tmp_path / "run" / "ckpt" / "latest"
    import json
    assert json.loads((latest / "config.json").read_text())["dtype"] == "bfloat16"
    shard = torch.load(latest / "trainer_rank1.pt", weights_only=False)
    assert any(m is not None and m.dtype == torch.float32 for m in shard["actor_opt"]["master"])
