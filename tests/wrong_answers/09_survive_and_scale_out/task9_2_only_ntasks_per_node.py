"""Checks the tasks per node only in SLURM_NTASKS_PER_NODE, which SLURM sets only when the job
asked --ntasks-per-node: a job of two tasks on each node, said in SLURM_TASKS_PER_NODE, passes."""

TASK = "task9_2"
EXPECT = r"SLURM_TASKS_PER_NODE"


def slurm_to_torchrun(env: Mapping[str, str], nproc_per_node: int | None = None) -> list[str]:
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
    tasks_per_node = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    if int(tasks_per_node) != 1:
        raise ValueError(f"SLURM_NTASKS_PER_NODE is {tasks_per_node}: start one torchrun per "
                         "node (srun --ntasks-per-node=1); it starts that node's processes")
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
