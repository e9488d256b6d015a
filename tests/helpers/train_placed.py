"""train.py with a placed world mesh: TITANSCALE_TEST_RANK_ORDER="1,0" sets the rank order
through the Trainer's hook (runtime.trainer.TitanscaleTrainer.rank_order)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from runtime.trainer import TitanscaleTrainer  # noqa: E402

order = os.environ.get("TITANSCALE_TEST_RANK_ORDER")
if order:
    TitanscaleTrainer.rank_order = [int(x) for x in order.split(",")]

sys.argv[0] = os.path.join(ROOT, "train.py")
import train  # noqa: E402

train.main(sys.argv[1:])
