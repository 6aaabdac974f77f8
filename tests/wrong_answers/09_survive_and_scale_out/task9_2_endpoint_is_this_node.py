"""Uses the node the script runs on (SLURMD_NODENAME) as the rendezvous endpoint: every node
waits for the others at its own address, and the job never starts."""

TASK = "task9_2"
EXPECT = r"the nodes of one job got different arguments"


def slurm_to_torchrun(env, nproc_per_node=None):
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env["SLURM_NNODES"])
    if nodes != len(hosts):
        raise ValueError(f"SLURM_JOB_NUM_NODES is {nodes}, the node list has {len(hosts)}")
    if int(env.get("SLURM_NTASKS_PER_NODE", "1")) != 1:
        raise ValueError("SLURM_NTASKS_PER_NODE must be 1")
    job = int(env["SLURM_JOB_ID"]) if "SLURM_JOB_ID" in env else None
    if job is None:
        raise ValueError("SLURM_JOB_ID is not set")
    if nproc_per_node is None:
        if "SLURM_GPUS_ON_NODE" in env:
            nproc_per_node = int(env["SLURM_GPUS_ON_NODE"])
        elif "SLURM_GPUS_PER_NODE" in env:
            nproc_per_node = int(env["SLURM_GPUS_PER_NODE"].rsplit(":", 1)[-1])
        else:
            raise ValueError("SLURM_GPUS_ON_NODE is not set")
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else 20000 + job % 10000
    here = env.get("SLURMD_NODENAME", hosts[0])  # this node, not the first
    return [f"--nnodes={nodes}", f"--nproc-per-node={nproc_per_node}", f"--rdzv-id={job}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={here}:{port}"]
