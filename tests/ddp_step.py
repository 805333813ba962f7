"""One PPO update on a fixed global batch, run by test_ddp.py under torchrun (N ranks) or plain python
(1 process). Every process builds the same global batch, keeps its own groups, updates, and rank 0
saves the parameters to argv[1]."""
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)

from advantage import grpo_advantage, token_advantages  # noqa: E402
from gym import build_tokenizer, word_format  # noqa: E402
from gyms import memory as gm  # noqa: E402
from model import TinyAgent  # noqa: E402
from rollout import collate, rollout_batch  # noqa: E402
import train  # noqa: E402

if int(os.environ.get('WORLD_SIZE', '1')) > 1:
    torch.distributed.init_process_group('gloo')
rank, world = train.rank(), train.world_size()
G, B = 4, 4  # group size, groups
cfg = dict(train.config, keep_tool_results=1, max_turns=5, max_response_tokens=16, max_len=256,
           mini_batches=2, ppo_epochs=1, loss_agg=sys.argv[2], kl_coef=0.0, max_tokens_per_microbatch=400)
tok = build_tokenizer(gm.memory_texts())
torch.manual_seed(0)
model = TinyAgent(tok.vocab_size, 2, 4, 32, 256)
tasks = gm.make_tasks('train', B, seed=1)
reps = [(g, t) for g, t in enumerate(tasks) for _ in range(G)]
model.eval()
trajs = rollout_batch(model, word_format(tok, memory=True), [gm.MemoryEnv() for _ in reps], [t for _, t in reps], cfg,
                      groups=[g for g, _ in reps], generator=torch.Generator().manual_seed(0))
for i, t in enumerate(trajs):  # an untrained policy earns nothing: give the groups a spread of rewards
    t.reward = float((i * 7) % 3 == 0)
    if sys.argv[3:] == ['invalid']:  # every episode of the odd groups (all of rank 1's, under 2 ranks) invalid
        t.valid = t.valid and t.group % 2 == 0
mine = [i for i, t in enumerate(trajs) if t.group % world == rank]  # whole groups per rank
local = [trajs[i] for i in mine]
batch = collate(local, tok.pad_id)
adv = token_advantages(grpo_advantage(batch['rewards'], batch['group_ids']), batch['row_episode'], batch['action_mask'])
opt = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD: Adam's g/|g| would magnify float rounding
m = train.ppo_update(model, opt, batch, adv, None, cfg, random.Random(0), torch.tensor(mine), len(trajs))
if rank == 0:
    torch.save(dict(params=[p.detach() for p in model.parameters()], metrics=m), sys.argv[1])
if world > 1:  # no rank tears gloo down while the other still works (aborted under load without it)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
