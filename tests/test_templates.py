"""Template-driven turns: hf reads the assistant header, the end-of-turn token and the role
headers from the model's own chat template. ChatML (Qwen3, SmolLM2) keeps its old constants; a
Llama-3-style template (<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>) on the real
Qwen vocabulary with Llama 3's four tokens added works turn by turn, through a memory-gym episode.
Scripted policies only: no model, nothing fetched from a hub."""
import copy
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest

import hf
from gyms import memory
from rollout import rollout_batch
from test_hf import segments  # [(owner, decoded text)] runs of equal owner

LLAMA3_TOKENS = ['<|begin_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']
# Llama 3's turn format; the tool role is its own 'ipython' header
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n' -}}"
    "{{- (m.content if m.content is string else '') + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}")
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'


@pytest.fixture(scope='module')
def qwen():
    return hf.qwen_tokenizer()


@pytest.fixture(scope='module')
def llama(qwen):
    tok = copy.deepcopy(qwen)
    tok.add_special_tokens({'additional_special_tokens': LLAMA3_TOKENS})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def ids_of(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def test_chatml_turns_are_the_former_constants(qwen):
    anchors = {'system': '<|im_start|>system\n', 'user': '<|im_start|>user\n', 'tool': '<tool_response>\n'}
    assert hf.chat_turns(qwen) == hf.ChatTurns('<|im_start|>assistant\n', hf.EMPTY_THINK, '<|im_end|>', 151645, anchors)
    assert hf.chat_turns(qwen) is hf.chat_turns(qwen)   # cached


def test_llama3_turns_and_stop_ids(llama):
    eot, eos = ids_of(llama, '<|eot_id|>', '<|im_end|>')   # eos stays the Qwen vocabulary's <|im_end|>
    t = hf.chat_turns(llama)
    assert (t.head, t.think, t.end, t.end_id) == ('<|start_header_id|>assistant<|end_header_id|>\n\n', '', '<|eot_id|>', eot)
    assert t.anchors == {r: f'<|start_header_id|>{h}<|end_header_id|>\n\n'
                         for r, h in (('system', 'system'), ('user', 'user'), ('tool', 'ipython'))}
    assert hf.stop_ids(llama) == [eot, eos]


@pytest.mark.parametrize('enable_thinking', [True, False])
def test_llama3_owners(llama, enable_thinking):
    a1, a2 = '<think>\nSearch it.\n</think>\n\n' + CALL, 'Paris'
    msgs = [{'role': 'system', 'content': 'Be brief'}, {'role': 'user', 'content': 'Capital of France?'},
            {'role': 'assistant', 'content': a1}, {'role': 'tool', 'content': 'Paris is the capital of France'},
            {'role': 'assistant', 'content': a2}]
    ids, owner = hf.render_conversation(llama, msgs, enable_thinking=enable_thinking)
    segs = segments(llama, ids, owner)
    assert [t for o, t in segs if o == hf.PROMPT] == ['Be brief', 'Capital of France?']
    assert [t for o, t in segs if o == hf.TOOL] == ['Paris is the capital of France']
    assert [t for o, t in segs if o == hf.POLICY] == [a1 + '<|eot_id|>', a2 + '<|eot_id|>']
    assert [t for o, t in segs if o == hf.TEMPLATE] == [
        '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n',
        '<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n',
        '<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
        '<|start_header_id|>ipython<|end_header_id|>\n\n',
        '<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n']


def test_llama3_pieces_reproduce_the_template(llama):
    """prompt_ids + sampled turn + <|eot_id|> + tool_turn_ids == the template's rendering."""
    eot = hf.chat_turns(llama).end_id
    p, po = hf.prompt_ids(llama, 'Be brief', 'Capital of France?')
    t, to = hf.tool_turn_ids(llama, 'Paris is the capital of France.')
    turn = llama.encode(CALL, add_special_tokens=False) + [eot]
    msgs = [{'role': 'system', 'content': 'Be brief'}, {'role': 'user', 'content': 'Capital of France?'},
            {'role': 'assistant', 'content': CALL}, {'role': 'tool', 'content': 'Paris is the capital of France.'}]
    ids, owner = hf.render_conversation(llama, msgs, add_generation_prompt=True)
    assert p + turn + t == ids and po + [hf.POLICY] * len(turn) + to == owner
    assert llama.decode(p).endswith('Capital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n')
    assert llama.decode(t) == ('<|start_header_id|>ipython<|end_header_id|>\n\nParis is the capital of France.'
                               '<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n')
    assert set(to) == {hf.TEMPLATE, hf.TOOL}
    # this template keeps history as sampled, <think> included
    assert hf.check_prefix_stability(llama)[0] and hf.check_prefix_stability(llama, assistant_texts=[CALL, 'Paris'])[0]


def test_memory_gym_episodes_in_llama3_end_every_turn_with_eot_and_are_solved(llama):
    fmt = hf.chat_format(llama, system=memory.SYSTEM_PROMPT, enable_thinking=True, memory=True)
    eot = hf.chat_turns(llama).end_id
    assert fmt.end_turn == fmt.fold_close == [eot] and fmt.stop_ids[0] == eot
    tasks = memory.make_tasks('train', 3, seed=0, n_objectives=(1, 2))
    cfg = dict(max_turns=10, max_len=1024, max_response_tokens=64, keep_tool_results=1, temperature=1.0)
    trajs = rollout_batch([memory.folded_policy(memory.oracle_policy)] * len(tasks), fmt,
                          [memory.MemoryEnv(max_turns=cfg['max_turns']) for _ in tasks], tasks, cfg)
    assert max(len(t.turns) for t in trajs) > 2
    for task, t in zip(tasks, trajs):
        assert t.info['stop'] == 'answer' and t.info['format_ok'] and t.reward == len(task.golds), t.info
        assert all(tr['finish'] == 'stop' and tr['response'][-1] == eot for tr in t.turns)
        assert [tr['response'] for tr in t.turns] == [fmt.encode(a) + [eot] for a in t.info['actions']]
        first = llama.decode(t.turns[0]['context'][0])
        assert first.startswith('<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nLook up')
        assert first.endswith('<|start_header_id|>assistant<|end_header_id|>\n\n<mem>\n')


@pytest.mark.parametrize('template, missing', [
    # the assistant's content followed by plain text, no end-of-turn token
    ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}\n\n{% endfor %}"
     "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}",
     r"ends an assistant turn with '\\n\\n'"),
    # no generation prompt
    ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}",
     'writes no assistant header'),
])
def test_a_template_whose_turns_cannot_be_found_raises_naming_the_model(llama, template, missing):
    tok = copy.copy(llama)   # a shallow copy: own chat_template, shared vocabulary
    tok.chat_template = template
    with pytest.raises(hf.TurnsError, match=missing):
        hf.stop_ids(tok)
    with pytest.raises(ValueError, match=f"^model '{tok.name_or_path}': its chat template {missing}"):
        hf.chat_format(tok, memory=True)


def test_a_template_without_tools_is_never_replaced_silently(llama, tmp_path):
    """A model folder whose template has no tool support keeps it (no silent swap); a gym that needs
    tool schemas stops with one line naming the model and the explicit choice; chat_template: qwen3
    (or a path) replaces it on request; a missing template file is one line too."""
    folder = tmp_path / 'llama-like'
    llama.save_pretrained(folder)
    tok = hf.load_tokenizer(str(folder))
    assert tok.chat_template == LLAMA3_TEMPLATE and not hf.has_tool_template(tok)
    hf.chat_format(tok, memory=True)  # a gym without tools is fine with it
    with pytest.raises(ValueError) as e:
        hf.chat_format(tok, tools=[{'type': 'function', 'function': {'name': 'read', 'description': 'r',
                                                                     'parameters': {'type': 'object', 'properties': {}}}}])
    msg = str(e.value)
    assert '\n' not in msg and str(folder) in msg and 'cannot render tool schemas' in msg and 'chat_template: qwen3' in msg
    assert hf.has_tool_template(hf.load_tokenizer(str(folder), chat_template='qwen3'))
    (tmp_path / 'mine.jinja').write_text(LLAMA3_TEMPLATE + '{# mine #}')
    assert hf.load_tokenizer(str(folder), chat_template=str(tmp_path / 'mine.jinja')).chat_template.endswith('{# mine #}')
    with pytest.raises(OSError) as e:
        hf.load_tokenizer(str(folder), chat_template=str(tmp_path / 'missing.jinja'))
    assert "config key 'chat_template': cannot read" in str(e.value) and '\n' not in str(e.value)
    (tmp_path / 'broken.jinja').write_text('{% for m in messages %}')  # does not parse: the file is named
    with pytest.raises(OSError) as e:
        hf.load_tokenizer(str(folder), chat_template=str(tmp_path / 'broken.jinja'))
    assert "'chat_template'" in str(e.value) and 'broken.jinja' in str(e.value) and 'cannot render' in str(e.value)
