#!/usr/bin/env bash
# T1 reproduction (arXiv 2609.11042): the one entry point.
#
#   bash run.sh                      # embedded pipeline end to end on this machine (CPU ok):
#                                    #   tasks -> base (copy pretraining) -> SFT -> critic warm-up -> PPO -> evals
#   bash run.sh --quick              # the same pipeline, tiny settings (a smoke run of a few minutes)
#   bash run.sh --full               # the same pipeline at the sizes of the learning targets (150 held-out
#                                    #   tasks, one RST step each, 48 RL steps on 1,152 fresh tasks, held-out
#                                    #   curve): ~1-2 h on 2 cores
#   bash run.sh --run-dir runs/x     # any train_t1.py flag passes through; same --run-dir resumes
#   bash run.sh test                 # the test suite (pytest, CPU only; GPU tests skip without CUDA)
#   bash run.sh qwen35-122b-a10b [--model-path DIR]   # cluster preset: checks GPUs/env/model, prints the
#   bash run.sh qwen35-35b-a3b   [--model-path DIR]   #   memory-model plan, starts/joins Ray, launches the run
#   bash run.sh gpu-check            # one prepared command: Megatron backend + memory model on one GPU
#   bash run.sh paper [--quick]      # the paper's comparisons (dense vs binary, PPO vs GRPO, warm vs cold critic,
#                                    #   R3 on / off) from one shared SFT run; the report appended to results/LOG.md
#   bash run.sh cluster-rehearsal [--quick]   # the cluster path on this CPU: `python -m cluster.launch launch`,
#                                    #   the planner's plan over 4 gloo Megatron ranks, an embedded engine, bubblewrap
#                                    #   (--sft-only: its Qwen3.5 SFT checkpoint alone, train_t1.py --stop-after sft)
#
# On a fresh machine this installs what the code needs: Debian packages (bubblewrap for the sandbox,
# tmux for the terminal, jq for the generated tasks), a virtual environment at .venv/ and requirements.txt (torch pinned to the
# CPU wheel). Nothing here ends processes by name: every process the pipeline starts it stops by pid.
set -euo pipefail
cd "$(dirname "$0")"

# --- Debian packages ---------------------------------------------------------------------------
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v tmux  >/dev/null 2>&1 || missing+=(tmux)
command -v jq    >/dev/null 2>&1 || missing+=(jq)   # the generated tasks' Dockerfile installs it; the local jail uses the host's
if [ ${#missing[@]} -gt 0 ]; then
  echo "[run.sh] installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- Python environments -----------------------------------------------------------------------
# uv (pinned, from PyPI into .venv) installs requirements.txt (~20 s on a fresh machine, where pip took ~50 s) and,
# side by side, Harbor (results/LOG.md, 2026-12-07). requirements.txt is byte-compiled at install, as pip did: else
# the first processes of a run compile what they import, several at once, and the verifier's pytest, run from .venv
# read-only inside each jail, cannot write a .pyc at all (without them 0.51-0.62 CPU-s, not 0.17-0.23). Harbor's venv
# is compiled as its CLI imports it. uv does not read pip's configuration: the find-links folders pip is given
# ($PIP_FIND_LINKS, pip's config; where this machine keeps the CPU torch wheel) are passed on.
UV_VERSION=0.13.10
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "[run.sh] creating .venv with $PY"
  "$PY" -m venv .venv
fi
if [ "$(.venv/bin/uv --version 2>/dev/null)" != "uv $UV_VERSION" ]; then
  .venv/bin/python -m pip install -q "uv==$UV_VERSION"
fi
links=()
for d in ${PIP_FIND_LINKS:-} $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true); do
  links+=(--find-links "$d")
done
uv_install() { .venv/bin/uv pip install -q "${links[@]}" "$@"; }  # uv_install --python PY ARGS

HPY=""  # Harbor (needs Python >= 3.12): its own venv, used by `--harness harbor`, `-m engine.gateway eval` and tests
for c in "${HARBOR_PYTHON:-}" python3.12 python3.13 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
  if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then HPY=$c; break; fi
done
harbor_pid=""
if [ ! -x .venv-harbor/bin/harbor ]; then
  if [ -n "$HPY" ]; then
    echo "[run.sh] creating .venv-harbor with $HPY and installing harbor==0.25.0"
    ( "$HPY" -m venv .venv-harbor && uv_install --python .venv-harbor/bin/python harbor==0.25.0 ) &
    harbor_pid=$!
  else
    echo "[run.sh] no Python 3.12 found (set HARBOR_PYTHON): the Harbor path and its test are unavailable"
  fi
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[run.sh] installing requirements.txt into .venv (uv $UV_VERSION)"
  uv_install --compile-bytecode --python .venv/bin/python -r requirements.txt
  echo "$want" > "$stamp"
fi
if [ -n "$harbor_pid" ] && ! wait "$harbor_pid"; then
  echo "[run.sh] installing harbor==0.25.0 into .venv-harbor failed (see uv's output above)" >&2
  rm -rf .venv-harbor  # a half-made venv would pass the check above next time
  exit 1
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the repository's modules byte-compiled once into their (git-ignored) __pycache__, not again by each process: on a
# machine that exports PYTHONDONTWRITEBYTECODE=1 every Ray actor, trainer rank and CLI of a run recompiled them
# (results/LOG.md, 2026-12-07)
unset PYTHONDONTWRITEBYTECODE

# --- dispatch -----------------------------------------------------------------------------------
case "${1:-}" in
  test)
    shift
    # three pytest workers on 2 cores (T1_TEST_WORKERS; 0 = one process): a third fills the cores while the others'
    # tests wait on trials and deadlines (two kept them 1.66 busy: 845 s, three 747 s, results/LOG.md 2026-12-08; four
    # on a loaded machine ran slower); longest first, a module with a costly fixture on one worker
    # (tests/suite_order.py: tests/durations.json); the 10 slowest at the end
    exec .venv/bin/python -m pytest -q -n "${T1_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder \
      --durations=10 tests "$@"
    ;;
  qwen35-122b-a10b|qwen35-35b-a3b)
    preset=$1; shift
    exec .venv/bin/python -m cluster.launch launch --preset "$preset" "$@"
    ;;
  gpu-check)
    shift
    exec .venv/bin/python -m cluster.launch gpu-check "$@"
    ;;
  paper)
    # the paper's comparisons in miniature: every arm's RL phase from one shared SFT run, the report
    shift
    exec .venv/bin/python -m experiments.paper run "$@"
    ;;
  cluster-rehearsal)
    # the cluster path on this CPU: the embedded SFT writes a Qwen3.5 HF checkpoint (runs/rehearsal-sft), then
    # `python -m cluster.launch launch --preset cpu-rehearsal` runs it as a cluster would: checks, the planner's plan
    # over 4 gloo trainer ranks (Megatron), an embedded engine as a Ray actor taking each publish over a gloo group,
    # bubblewrap jails; the same --run-dir resumes. --quick: tiny settings; other flags go to train_t1.py
    # (T1_REHEARSAL_SFT: a checkpoint's run directory already written is reused; --sft-only: stop once it is written)
    shift
    quick=(); rest=(); sft_only=0
    for a in "$@"; do
      case "$a" in --quick) quick=(--quick) ;; --sft-only) sft_only=1 ;; *) rest+=("$a") ;; esac
    done
    sft=${T1_REHEARSAL_SFT:-runs/rehearsal-sft}
    if [ ! -f "$sft/ckpt/sft/config.json" ]; then  # the same flags, then what makes it an SFT-only run
      .venv/bin/python train_t1.py "${quick[@]}" "${rest[@]}" --arch qwen3_5_moe --run-dir "$sft" --stop-after sft
    fi
    if [ "$sft_only" = 1 ]; then exit 0; fi
    exec .venv/bin/python -m cluster.launch launch --preset cpu-rehearsal --model-path "$sft/ckpt/sft" \
      --run-dir "${T1_REHEARSAL_RUN:-runs/rehearsal}" -- "${quick[@]}" "${rest[@]}"
    ;;
  *)
    exec .venv/bin/python train_t1.py "$@"
    ;;
esac
