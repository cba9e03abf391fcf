"""mcore_weights.load_checkpoint_into_megatron: a rank reads only its part of an HF checkpoint's safetensors (its
pipeline stage's layers, its EP rank's experts, its TP / expert-TP block of the tensors cut whole) and gets the same
weights, bit for bit, as mcore_weights.load_hf_into_megatron of the whole state dict
(AutoModelForCausalLM.from_pretrained, fp32, what model.load_actor gives). Checkpoints: tiny Qwen3.5-MoE and Qwen3-MoE
written by save_pretrained (each expert's own tensors), also sharded (max_shard_size: model.safetensors.index.json), and
the fused-expert layout with the `model.language_model.` prefix of Qwen3.5's released checkpoints (written with
safetensors' save_file).

Measured (python -m pytest tests/test_mcore_load.py -s; bytes fetched / the files' size, per rank, tiny Qwen3.5,
vocab 96, fp32): TP = 2: 0.79 / 0.79 (fc1, in_proj, conv1d, linear_qkv read whole for a layer, then cut); EP = 2:
0.68 / 0.68 (at this size the dense part is a third of the model); PP = 2 (sharded files): 0.46 / 0.50; TP = 2,
ETP = 1, EP = 2: 0.60 / 0.60 (fused experts: 0.62 / 0.62); Qwen3-MoE EP = 2 (sharded files): 0.72 / 0.72. Qwen3-MoE
is not built at TP = 2 on CPU (its local spec's torch norm refuses sequence parallel)."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")
import gloo_pool  # noqa: E402
from cluster import mcore  # noqa: E402
from cluster import mcore_cpu  # noqa: E402
from cluster import mcore_weights  # noqa: E402

pytestmark = pytest.mark.ranks  # on tests/gloo_pool.py's kept ranks: one unit with the others (tests/suite_order.py)

V = 96
ARCHS = {"qwen35": mcore.tiny_qwen35_hf_config, "qwen3": mcore.tiny_hf_config}


def save_tiny(arch, path, max_shard_size=None, fused=False):
    """A tiny random HF checkpoint of `arch` at `path` (norms, gates, dt_bias, A_log moved off their init, so every
    conversion rule matters) -> its config."""
    from transformers import AutoModelForCausalLM
    hf = ARCHS[arch](V)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "gate" in name or "dt_bias" in name or "A_log" in name:
                p.add_(0.1 * torch.randn(p.shape))
    if fused:  # Qwen3.5's released layout: experts fused (E, 2I, H) / (E, H, I), under model.language_model.
        import os
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        hf.save_pretrained(path)
        save_file({k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in m.state_dict().items()},
                  os.path.join(path, "model.safetensors"))
    else:
        m.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return hf


def hf_state_dict(path, hf):
    """The whole model's state dict as the trainer loaded it before (model.load_actor: from_pretrained, fp32)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()


def weights(gpt) -> dict:
    return {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}


def compare(path, hf, **layout) -> tuple[list, dict]:
    """Both loaders into this rank's model of `layout` -> (keys whose tensors differ (empty: bit-identical), stats)."""
    ref = weights(mcore_weights.load_hf_into_megatron(mcore.build_tiny(hf, **layout), hf_state_dict(path, hf), hf))
    stats = {}
    got = weights(mcore_weights.load_checkpoint_into_megatron(mcore.build_tiny(hf, seed=1, **layout), path, hf, stats))
    assert ref.keys() == got.keys()
    return [k for k in ref if not (ref[k].dtype == got[k].dtype and torch.equal(ref[k], got[k]))], stats


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    kinds = [("qwen35", "single", {}), ("qwen35", "sharded", {"max_shard_size": "40KB"}),
             ("qwen35", "fused", {"fused": True}), ("qwen3", "single", {}),
             ("qwen3", "sharded", {"max_shard_size": "40KB"})]
    return {(arch, kind): (root / f"{arch}_{kind}", save_tiny(arch, root / f"{arch}_{kind}", **kw))
            for arch, kind, kw in kinds}


@pytest.mark.parametrize("arch,kind", [("qwen35", "single"), ("qwen35", "sharded"), ("qwen35", "fused"),
                                       ("qwen3", "single"), ("qwen3", "sharded")])
def test_streaming_load_is_bit_identical_at_one_rank(checkpoints, arch, kind):
    path, hf = checkpoints[arch, kind]
    if kind == "sharded":
        assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 2
    mcore_cpu.init_cpu()
    differ, stats = compare(path, hf)
    print(f"{arch} {kind}: read {stats['read_bytes'] / stats['file_bytes']:.2f} of the files")
    assert differ == []
    assert stats["read_bytes"] <= stats["file_bytes"]


def test_missing_tensor_is_refused(checkpoints, tmp_path):
    """A checkpoint without a tensor the model needs raises (a KeyError naming it), as the strict check would."""
    import os
    from safetensors.torch import load_file, save_file
    path, hf = checkpoints["qwen3", "single"]
    sd = load_file(str(path / "model.safetensors"))
    del sd["model.layers.1.self_attn.k_norm.weight"]
    os.makedirs(tmp_path / "ck")
    save_file(sd, str(tmp_path / "ck" / "model.safetensors"))
    mcore_cpu.init_cpu()
    with pytest.raises(KeyError, match="k_norm"):
        mcore_weights.load_checkpoint_into_megatron(mcore.build_tiny(hf), tmp_path / "ck", hf)


def _load_rank(rank, world, path, arch, tp, ep, etp, pp):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp, pipeline_model_parallel_size=pp)
    mcore_cpu.init_cpu()  # shims only: the group and parallel state above are kept
    hf = ARCHS[arch](V)
    return compare(path, hf, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=etp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                   sequence_parallel=tp > 1)


@pytest.mark.parametrize("arch,kind,tp,ep,etp,pp", [("qwen35", "single", 2, 1, None, 1),
                                                    ("qwen35", "single", 1, 2, None, 1),
                                                    ("qwen35", "sharded", 1, 1, None, 2),
                                                    ("qwen35", "fused", 2, 2, 1, 1),
                                                    ("qwen35", "single", 2, 2, 1, 1),
                                                    ("qwen3", "sharded", 1, 2, None, 1)])
def test_each_rank_reads_only_its_part_and_loads_the_same_shards(checkpoints, arch, kind, tp, ep, etp, pp):
    """Over 2 gloo ranks: every rank's state dict bit-identical to load_hf_into_megatron's shard; with EP = 2 or
    PP = 2 each rank fetches at most 0.75 of the checkpoint's bytes."""
    path, _ = checkpoints[arch, kind]
    res = gloo_pool.ranks(_load_rank, 2, path, arch, tp, ep, etp, pp, timeout_s=300)
    fractions = [s["read_bytes"] / s["file_bytes"] for _, s in res]
    print(f"{arch} {kind} tp={tp} ep={ep} etp={etp} pp={pp}: bytes read / file bytes per rank "
          + " / ".join(f"{f:.2f}" for f in fractions))
    assert [differ for differ, _ in res] == [[], []]
    if ep > 1 or pp > 1:
        assert max(fractions) <= 0.75
