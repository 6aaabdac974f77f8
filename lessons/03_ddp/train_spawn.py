"""The same training as ``train_ddp.py``, but the script starts its own processes.

    python lessons/03_ddp/train_spawn.py --nprocs 2

``torch.multiprocessing.spawn`` starts ``--nprocs`` fresh Python processes and calls
``worker(index, ...)`` in each. The parent waits for them all; when one fails, it stops the
others and raises an exception that carries the failed process's traceback, or its exit code.
There is no launcher, so the script plays its part: it sets RANK, WORLD_SIZE and the rest in
each process, and picks a free port for them to meet on. Every other option (--epochs,
--batch-size, --checkpoint, ...) goes to train_ddp.py unchanged; --batch-size is per process.

Prefer torchrun: it handles several machines, can restart the workers when asked
(``--max-restarts``; the default, 0, restarts nothing), and keeps launching out of your code.
Spawn is handy where a script must be started as plain ``python``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch.multiprocessing as mp

# The model, data and training loop are train_ddp.py's: only the start-up differs.
import train_ddp
from gpt.run import positive_int  # train_ddp.py has put lessons/ on the path


def worker(index: int, nprocs: int, port: int, argv: list[str]) -> None:
    # Describe the job exactly as torchrun would, then run the unchanged training code.
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    code = train_ddp.main(argv)
    if code:  # a usage error, explained on stderr: exit with its code, so the parent sees it
        sys.exit(code)


def free_port() -> int:
    """A port the OS says is free now (never a fixed number that may be taken)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=positive_int, default=2)
    args, rest = parser.parse_known_args(argv)  # the rest goes to train_ddp.py
    try:
        # join=True: wait for every process; a failure in one is raised here.
        mp.spawn(worker, args=(args.nprocs, free_port(), rest), nprocs=args.nprocs, join=True)
    except mp.ProcessExitedException as failed:
        if failed.exit_code <= 0:  # killed by a signal: nothing was explained, show it all
            raise
        return failed.exit_code  # a worker's usage error: it said why on stderr
    return 0


# The guard matters: spawned processes import this file, and must not spawn again.
if __name__ == "__main__":
    sys.exit(main())
