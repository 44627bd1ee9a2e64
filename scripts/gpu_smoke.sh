#!/usr/bin/env bash
# One-GPU smoke: short GRPO with an SGLang engine and the megatron + transformer-engine trainer,
# colocated; weights reach SGLang by /update_weights_from_disk (NCCL cannot put two ranks on one
# GPU). With 2+ GPUs, drop --colocate and append `--update-weight-transfer-mode broadcast` for the
# NCCL path. Prints the --ci-test step-0 checkers and perf/* timings.
#   MODEL=/models/Qwen3-0.6B DATA=/data/train.jsonl scripts/gpu_smoke.sh [extra flags]
# Needs: pip install -e '.[gpu]' (transformer-engine), sglang in its own venv (requirements-sglang.txt;
# SGLANG_PY=path/to/its/python, default $PY), one CUDA GPU, an HF checkpoint.
# --ci-disable-weight-update-checker: SGLang's Qwen2/Qwen3 classes lack get_weights_by_name; drop it
# for a model whose class has it (e.g. Llama) to check trainer == engine weights too.
# Not run in CI here (no GPU); tests marked @pytest.mark.gpu cover the same path.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${MODEL:?set MODEL to an HF checkpoint dir (e.g. Qwen3-0.6B)}"
DATA="${DATA:-}"
ROOT="${ROOT:-$(mktemp -d /tmp/miles_gpu_smoke.XXXX)}"
PY="${PY:-.venv/bin/python}"
SGLANG_PY="${SGLANG_PY:-$PY}"
LOG="$ROOT/gpu_smoke.log"
export TOKENIZERS_PARALLELISM=false CUDA_DEVICE_MAX_CONNECTIONS=1

nvidia-smi -L >/dev/null 2>&1 || { echo "gpu_smoke: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2; exit 2; }
"$PY" -c "import transformer_engine" 2>/dev/null \
  || { echo "gpu_smoke: install the gpu extra first: pip install -e '.[gpu]'" >&2; exit 2; }
"$SGLANG_PY" -c "import sglang" 2>/dev/null \
  || { echo "gpu_smoke: no sglang in $SGLANG_PY: pip install -r requirements-sglang.txt (own venv)" >&2; exit 2; }
export MILES_SGLANG_PYTHON="$SGLANG_PY"
if [[ -z "$DATA" ]]; then
  DATA="$ROOT/data/train.jsonl"
  "$PY" -m miles_platform.cli make-data --out "$(dirname "$DATA")" >/dev/null
fi

set -x
"$PY" -m miles_platform.cli train \
  --train-backend megatron \
  --rollout-engine sglang \
  --update-weight-transfer-mode disk \
  --hf-checkpoint "$MODEL" \
  --prompt-data "$DATA" \
  --input-key prompt --label-key label \
  --rm-type math \
  --ci-test --ci-disable-weight-update-checker \
  --num-rollout 3 \
  --rollout-batch-size 4 \
  --n-samples-per-prompt 4 \
  --global-batch-size 16 \
  --rollout-max-response-len 128 \
  --rollout-temperature 1.0 \
  --advantage-estimator grpo \
  --lr 1e-6 \
  --train-forward-dtype fp32 --rollout-dtype fp32 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 \
  --colocate --rollout-num-gpus-per-engine 1 \
  --sglang-mem-fraction-static 0.4 \
  --storage-root "$ROOT" \
  "$@" 2>&1 | tee "$LOG"
set +x

echo "---- step-0 checkers (--ci-test) ----"
grep -E "ci[-_ ]test|step[-_ ]?0|train_rollout_logprob_abs_diff|ppo_kl|pg_clipfrac|weight.*equal" "$LOG" || true
echo "---- perf/* timings ----"
grep -oE "perf/[a-z_]+[=: ]+[0-9.eE+-]+" "$LOG" || echo "(no perf/* metrics found in $LOG)"
echo "gpu_smoke: OK, log at $LOG"
