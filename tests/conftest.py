import os
import sys

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # a hub look-up otherwise hangs ~48 s before failing
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run, so a red CI is reproducible and never flaky.
# To explore new examples: HYPOTHESIS_PROFILE=explore python -m pytest ...
settings.register_profile('default', derandomize=True, database=None)
settings.register_profile('explore', derandomize=False)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'default'))

torch.set_num_threads(1)


