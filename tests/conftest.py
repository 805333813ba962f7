import os
import sys

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # a hub look-up otherwise hangs ~48 s before failing
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)


