"""
The smallest gym, and the one to copy: guess a secret number from 0 to 7 in max_turns turns with one
tool, `<call> guess N </call>`, answered `higher`, `lower` or `correct`. The warm start imitates a
player who guesses any number the answers so far allow (binary search would always win in 4 turns).

    python train.py config/example.yaml

Start your own: copy this file to gyms/<name>.py, change the tasks, the env and the texts, and set
`gym: <name>` in a config. The contract (what setup returns, what reset/step return) is in gym.py.
"""

from gym import build_tokenizer, word_format

MODEL = 'tiny'  # the gym builds its own word vocabulary, for the tiny model
KEYS = ()       # gym-specific config keys this gym reads (none)
N = 8
PROMPT = f'guess my number from 0 to {N - 1}'


class GuessEnv:
    def __init__(self, max_turns):
        self.max_turns = max_turns

    def reset(self, task):
        self.secret, self.turns, self.n_invalid = task, 0, 0
        return PROMPT

    def step(self, action, finish='stop'):
        """(observation, reward, done, info); a cut turn (finish 'length') is a malformed call. info at the end
        counts turns and malformed calls (n_invalid; sample.py prints it)."""
        self.turns += 1
        words = action.split()
        if finish != 'stop' or words[:2] != ['<call>', 'guess'] or len(words) != 4 or not words[2].isdigit():
            obs, self.n_invalid = 'error : malformed call', self.n_invalid + 1
        elif int(words[2]) == self.secret:
            return 'correct', 1.0, True, dict(success=True, stop='answer', n_turns=self.turns, n_invalid=self.n_invalid)
        else:
            obs = 'higher' if int(words[2]) < self.secret else 'lower'
        if self.turns >= self.max_turns:
            return obs, 0.0, True, dict(success=False, stop='budget', n_turns=self.turns, n_invalid=self.n_invalid)
        return obs, 0.0, False, {}


def consistent_guesser(rng):
    """A scripted policy (episode -> action text): any number that the answers so far allow."""
    def act(ep):
        lo, hi = 0, N - 1
        for action, obs in zip(ep.actions, ep.texts[1:]):
            if obs in ('higher', 'lower'):  # a malformed call (e.g. cut at max_response_tokens) tells nothing
                guess = int(action.split()[2])
                lo, hi = (guess + 1, hi) if obs == 'higher' else (lo, guess - 1)
        return f'<call> guess {rng.randint(lo, max(lo, hi))} </call>'
    return act


def setup(cfg, vocab=None):
    """What train.py needs from this gym (gym.py, "the contract")."""
    texts = [PROMPT, 'higher lower correct error : malformed call <call> guess </call>'] + [str(n) for n in range(N)]
    tok = build_tokenizer(texts, vocab)
    secrets = list(range(N))  # a toy: held-out episodes draw the same secrets as training
    return dict(tok=tok, fmt=word_format(tok), train_tasks=secrets, eval_tasks=secrets,
                make_env=lambda: GuessEnv(cfg['max_turns']), warm_policy=consistent_guesser,
                baselines={}, answer_text=None)
