"""Job for the session's ranks (``tests/_ranks.py``): ``examples/train_lm.py``'s ``main`` on
every rank, in the environment ``torchrun`` gives its workers, in the rank's process group."""

import json
import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def main(rank, world, argv):
    """Runs the job with the command-line arguments ``argv``; returns its summary (what the
    script prints as its last line on rank 0) as the printed JSON reads back."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_lm

    return json.loads(json.dumps(train_lm.main(argv)))
