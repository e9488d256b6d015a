"""`python -m tools.lighthouse --port P --min-replicas M --ready FILE`: serve torchft's
lighthouse until SIGTERM (the Slurm job script's lighthouse step).

The lighthouse is launch.ft_local's (`start_lighthouse`: the same join timeout as
`tools.launch --local`), bound to every interface on port P. Once it listens, its port is
written to FILE (atomically: a temporary file renamed), which the job script waits for
before it starts the replica groups' steps; the groups reach it as http://<this node>:P.
SIGTERM or SIGINT (srun's forwarding when the script ends the step) shuts it down, exit 0.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from tools.cli import ArgumentParser, run


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m tools.lighthouse", description=__doc__)
    ap.add_argument("--port", type=int, required=True, help="port to listen on (all interfaces)")
    ap.add_argument("--min-replicas", type=int, default=1, help="groups a quorum needs (1)")
    ap.add_argument("--ready", default="", help="file to write the port to once listening")
    args = ap.parse_args(argv)
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"expected a port from 1 to 65535, got {args.port}", key="--port")
    if args.min_replicas < 1:
        raise ConfigError(f"expected at least 1, got {args.min_replicas}", key="--min-replicas")
    from launch.ft_local import start_lighthouse

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    lh = start_lighthouse(args.min_replicas, port=args.port)
    try:
        print(f"lighthouse {lh.address()} (port {args.port}, min_replicas "
              f"{args.min_replicas})", flush=True)  # fmt: skip
        if args.ready:
            tmp = Path(f"{args.ready}.tmp-{os.getpid()}")
            tmp.write_text(f"{args.port}\n")
            tmp.replace(args.ready)
        while not stop.wait(1.0):
            pass
    finally:
        lh.shutdown()
    print("lighthouse stopped", flush=True)
    return 0


if __name__ == "__main__":
    run(main)
