"""train_t1.check_args: every numeric flag is validated up front, naming --flag-name and the value, before any
work starts (no run directory, no Ray)."""
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

import infra
import train_t1 as T

ROOT = Path(__file__).resolve().parent.parent
NUMERIC_FIELDS = [f for f in dataclasses.fields(T.Args)
                  if type(f.default) in (int, float)]

# (field, bad value): hand-picked cases first, then the rest of the table below walks every field
NAMED = [("rl_steps", -1), ("minibatch_size", 0), ("temperature", -0.5), ("temperature", 0.0),
         ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.01), ("reward_scale", 0.0), ("reward_scale", -20.0),
         ("rollout_actors", 0), ("n_engines", -1), ("rollout_workers", 0), ("actor_lr", -1e-6),
         ("critic_lr", math.inf), ("clip_eps", 0.0), ("clip_eps_v", -0.2), ("kl_coef", -0.1),
         ("entropy_coef", math.nan), ("aux_loss_coef", -1.0), ("gamma", 1.5), ("lam", -0.1),
         ("trial_timeout_s", math.inf), ("max_grad_norm", 0.0), ("ppo_epochs", 0), ("eval_top_p", 2.0),
         ("sft_batch_size", 0), ("n_launch", 0), ("rl_steps", 2.5), ("seed", True)]


def bad_values(field: dataclasses.Field) -> list:
    """Values outside the field's range: below its lower bound, above an upper bound of 1, and non-finite."""
    rule = T.NUMERIC[field.name]
    out = {">= 0": [-1], ">= 1": [0, -1], "> 0": [0, -1], "in (0, 1]": [0, 2], "in [0, 1]": [-1, 2]}[rule]
    if type(field.default) is float:
        out = [float(v) for v in out] + [math.nan, math.inf, -math.inf]
    else:
        out = out + [1.5]  # a float where an integer is expected
    return out


def test_every_numeric_field_has_a_range():
    assert NUMERIC_FIELDS and {f.name for f in NUMERIC_FIELDS} == set(T.NUMERIC)


def test_defaults_and_presets_pass():
    for name, preset in T.PRESETS.items():
        T.check_numbers(preset)


@pytest.mark.parametrize("field,bad", NAMED + [(f.name, v) for f in NUMERIC_FIELDS for v in bad_values(f)])
def test_bad_numeric_flag_is_refused_naming_flag_and_value(field, bad):
    args = dataclasses.replace(T.QUICK, **{field: bad})
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError) as e:
        T.check_args(args)
    assert str(e.value).startswith(flag + ":") and repr(bad) in str(e.value), str(e.value)


def test_n_keep_above_n_launch_is_refused():
    with pytest.raises(ValueError, match="--n-keep: .* got 11"):
        T.check_args(dataclasses.replace(T.QUICK, n_launch=10, n_keep=11))


def test_sft_rst_share_without_an_sft_pool_or_rst_steps_is_refused():
    with pytest.raises(ValueError, match="--sft-rst-share 0.25: .*--n-sft-tasks and --rst-rounds"):
        T.check_args(dataclasses.replace(T.EMBEDDED, sft_rst_share=0.25))  # rst_rounds 0: nothing to share out
    with pytest.raises(ValueError, match="--sft-rst-share 0.5"):
        T.check_args(dataclasses.replace(T.FULL, n_sft_tasks=0, sft_rst_share=0.5))
    T.check_args(dataclasses.replace(T.FULL, sft_rst_share=0.25))


def test_refused_flags_create_no_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="--minibatch-size"):
        T.train(dataclasses.replace(T.QUICK, run_dir=str(run_dir), minibatch_size=0))
    assert not run_dir.exists()
    out = subprocess.run([sys.executable, "train_t1.py", "--quick", "--run-dir", str(run_dir), "--reward-scale", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--reward-scale: must be > 0, got 0.0" in out.stderr
    assert "Traceback" not in out.stderr and not run_dir.exists()


def test_model_path_with_megatron_is_checked_not_refused(tmp_path):
    """--model-path with --backend megatron builds the trainer's Megatron models from that checkpoint (the cluster
    path's CPU rehearsal); refused by name: a layout the converter does not know, and a checkpoint whose CPU
    trainer state (fp32 or bf16 + fp32 masters) would not fit this machine's memory (a sparse file stands in for
    10 TiB of bf16 weights)."""
    import json
    import os

    def ckpt(name, model_type, dtype, size):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type, "dtype": dtype}))
        with open(d / "model.safetensors", "wb") as f:
            f.truncate(size)
        return str(d)
    infra.check_megatron_model_path(ckpt("small", "qwen3_5_moe_text", "float32", 10 * 2**20))  # passes
    with pytest.raises(ValueError, match="--model-path: .* 'llama' model"):
        infra.check_megatron_model_path(ckpt("llama", "llama", "bfloat16", 2**20))
    with pytest.raises(ValueError, match=r"--model-path: .*GiB of weights.*28 bytes a parameter"):
        infra.check_megatron_model_path(ckpt("huge", "qwen3_5_moe", "bfloat16", 10 * 2**40))
    with pytest.raises(ValueError, match=r"--model-path: .*GiB of weights.*30 bytes a parameter"):
        infra.check_megatron_model_path(str(tmp_path / "huge"), "bf16")
    args = T.parse_args(["--backend", "megatron", "--model-path", str(tmp_path / "huge"), "--run-dir",
                         str(tmp_path / "run")])
    with pytest.raises(ValueError, match="bytes a parameter"):
        T.check_args(args)
    assert not os.path.exists(tmp_path / "run")


def test_param_dtype_is_checked():
    """--param-dtype: fp32 | bf16, bf16 only with the Megatron trainer (the hf one holds fp32 and torch's Adam); the
    cluster presets train in bf16."""
    with pytest.raises(ValueError, match="--param-dtype: expected one of fp32|bf16, got 'fp16'"):
        T.check_args(dataclasses.replace(T.QUICK, backend="megatron", param_dtype="fp16"))
    with pytest.raises(NotImplementedError, match="--param-dtype bf16 with --backend hf"):
        T.check_args(dataclasses.replace(T.QUICK, param_dtype="bf16"))
    assert T.PRESETS["qwen35-122b-a10b"].param_dtype == "bf16" and T.EMBEDDED.param_dtype == "fp32"
