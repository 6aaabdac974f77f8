"""Print the torchrun arguments for this node of a SLURM job, read from its SLURM_* variables.

    torchrun $(python lessons/09_survive_and_scale_out/slurm_args.py) train_resilient.py ...

slurm/train.sbatch runs it on every node (one task per node): every node gets the same
arguments, with the first host of the job's node list as the rendezvous endpoint. To try it
without a cluster, give the variables yourself:

    python lessons/09_survive_and_scale_out/slurm_args.py --env SLURM_JOB_ID=4242 \
        --env SLURM_JOB_NUM_NODES=2 --env "SLURM_JOB_NODELIST=node[01-02]" \
        --env SLURM_GPUS_ON_NODE=4
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order: ``"node[01-03,07],gpu5"`` gives
    ``["node01", "node02", "node03", "node07", "gpu5"]``.

    Commas separate hosts, except inside brackets; a bracket holds numbers and ranges
    ``a-b``, and a range keeps the width of its first number (``[08-10]``: 08, 09, 10). A name
    with several brackets expands to every combination (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1,
    r2n2), as ``scontrol show hostnames`` does.

    ``ValueError`` for: an empty list, or an empty host (``a,,b``, a trailing comma); brackets
    that do not pair up (one left unclosed, ``node[1-2``; nested, ``node[[1-2]]``; a ``]``
    before its ``[``), with a message that says ``bracket``; a number in a bracket that is not
    plain digits (``node[a-3]``, ``node[+1]``, ``node[ 1]``: ``int()`` alone would take the
    last two); a range that runs backwards.
    """
    def expand(host: str) -> list[str]:  # the first bracket, then the rest of the name
        match = re.search(r"\[([^\]]*)\]", host)
        if not match:
            if not host or "]" in host:
                raise ValueError(f"bad host {host!r} in node list {nodelist!r}")
            return [host]
        head, tail = host[:match.start()], host[match.end():]
        numbers = []
        for part in match.group(1).split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"bad range {part!r} in node list {nodelist!r}")
            if high and int(high) < int(low):
                raise ValueError(f"range {part!r} runs backwards in node list {nodelist!r}")
            numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
        rests = expand(tail) if tail else [""]  # the brackets further right
        return [head + number + rest for number in numbers for rest in rests]

    if not nodelist.strip():
        raise ValueError("the node list is empty")
    hosts, depth, begin = [], 0, 0
    for i, char in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in node list {nodelist!r}")
        if char == "," and depth == 0:
            hosts += expand(nodelist[begin:i].strip())
            begin = i + 1
    if depth:
        raise ValueError(f"unclosed bracket in node list {nodelist!r}")
    return hosts


def slurm_to_torchrun(env: Mapping[str, str], nproc_per_node: int | None = None) -> list[str]:
    """The arguments for ``torchrun`` on one node of a SLURM job, from that node's environment.

    The job runs one torchrun per node (``srun --ntasks-per-node=1 torchrun ...``); each
    starts that node's processes. Returns, in this order::

        --nnodes=<SLURM_JOB_NUM_NODES>  --nproc-per-node=<GPUs on this node>
        --rdzv-id=<SLURM_JOB_ID>  --rdzv-backend=c10d  --rdzv-endpoint=<first host>:<port>

    - the first host of ``SLURM_JOB_NODELIST`` (expanded) is the endpoint on every node: all
      of them must meet at the same address;
    - the port is ``MASTER_PORT`` when set, else ``20000 + SLURM_JOB_ID % 10000``: two jobs
      sharing a node then do not collide on one port;
    - the GPUs: ``nproc_per_node`` when given, else ``SLURM_GPUS_ON_NODE``, else the number at
      the end of ``SLURM_GPUS_PER_NODE`` (``"4"`` or ``"h100:4"``);
    - ``SLURM_NNODES`` and ``SLURM_NODELIST`` are older names of the same two variables, read
      when the new name is not set (or empty); when both are set, the new name wins.

    ``ValueError`` (naming the variable) for: a variable missing, a node count that is not
    the node list's length, more than one task on a node (several torchruns on one node
    would each start every process), or no GPU count at all. The tasks per node are in
    ``SLURM_TASKS_PER_NODE``, which SLURM sets in every job, in its compressed form
    (``"1(x4)"``: 1 task on each of 4 nodes; ``"2(x3),1"``: 2 on each of 3, then 1), and in
    ``SLURM_NTASKS_PER_NODE``, which it sets only when the job asked ``--ntasks-per-node``:
    check both, and every count in them must be 1. A value of either not in that form
    (``"1(x4"``, ``"one"``) raises ``ValueError`` naming it too.
    The test runs a table of emulated SLURM environments.
    """
    def need(*names: str) -> str:
        for name in names:
            if env.get(name):
                return env[name]
        raise ValueError(f"{' or '.join(names)} is not set: is this running inside a SLURM "
                         "job (sbatch/srun)?")

    hosts = expand_nodelist(need("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    nodes = int(need("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    if nodes != len(hosts):
        raise ValueError(f"SLURM_JOB_NUM_NODES is {nodes} but the node list has "
                         f"{len(hosts)} hosts: {hosts}")
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        counts = []
        for part in env.get(name, "").split(","):  # "2(x3),1": 2 on each of 3 nodes, then 1
            match = re.fullmatch(r"\s*(\d+)(\(x\d+\))?\s*", part)
            if part.strip() and not match:
                raise ValueError(f"{name} is {env[name]!r}, not counts like 1(x4) or 2,1")
            counts += [int(match.group(1))] if match else []
        if any(count != 1 for count in counts):
            raise ValueError(f"{name} is {env[name]}: start one torchrun per node (srun "
                             "--ntasks-per-node=1); it starts that node's processes")
    job = int(need("SLURM_JOB_ID"))
    if nproc_per_node is None:
        if env.get("SLURM_GPUS_ON_NODE"):
            nproc_per_node = int(env["SLURM_GPUS_ON_NODE"])
        elif env.get("SLURM_GPUS_PER_NODE"):
            nproc_per_node = int(env["SLURM_GPUS_PER_NODE"].rsplit(":", 1)[-1])
        else:
            raise ValueError("no GPU count: SLURM_GPUS_ON_NODE and SLURM_GPUS_PER_NODE are not "
                             "set (ask for --gpus-per-node) and nproc_per_node was not given")
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else 20000 + job % 10000
    return [f"--nnodes={nodes}", f"--nproc-per-node={nproc_per_node}", f"--rdzv-id={job}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{port}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set (or override) a variable, to try it outside a job")
    parser.add_argument("--nproc-per-node", type=int, help="processes per node (default: GPUs)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    for item in args.env:
        name, equals, value = item.partition("=")
        if not equals:
            parser.error(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    try:
        print(" ".join(slurm_to_torchrun(env, args.nproc_per_node)))
    except ValueError as err:
        print(f"{os.path.basename(__file__)}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
