"""Always rendezvous on torch's usual port 29500: two jobs that share a node collide."""

TASK = "task9_2"
EXPECT = r"Only the port differs"


def slurm_to_torchrun(env, nproc_per_node=None):
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env["SLURM_NNODES"])
    if nodes != len(hosts):
        raise ValueError(f"SLURM_JOB_NUM_NODES is {nodes}, the node list has {len(hosts)}")
    if int(env.get("SLURM_NTASKS_PER_NODE", "1")) != 1:
        raise ValueError("SLURM_NTASKS_PER_NODE must be 1")
    if "SLURM_JOB_ID" not in env:
        raise ValueError("SLURM_JOB_ID is not set")
    job = int(env["SLURM_JOB_ID"])
    if nproc_per_node is None:
        if "SLURM_GPUS_ON_NODE" in env:
            nproc_per_node = int(env["SLURM_GPUS_ON_NODE"])
        elif "SLURM_GPUS_PER_NODE" in env:
            nproc_per_node = int(env["SLURM_GPUS_PER_NODE"].rsplit(":", 1)[-1])
        else:
            raise ValueError("SLURM_GPUS_ON_NODE is not set")
    port = int(env.get("MASTER_PORT") or 29500)
    return [f"--nnodes={nodes}", f"--nproc-per-node={nproc_per_node}", f"--rdzv-id={job}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{port}"]
