"""Runs each local expert once per source rank's chunk: the numbers are right, but an expert
runs W small products instead of one."""

TASK = "task11_4"
EXPECT = r"local expert \d+ ran \d+ times, on \[.*\] rows; .*run each expert once"
REPLACE = {"expert_parallel_forward": [
    ("    done = torch.cat([expert(piece) for expert, piece in zip(local_experts, pieces, "
     "strict=True)])\n",
     "    done = torch.cat([torch.cat([expert(part) for part in piece.split(\n"
     "        from_each[:, j].tolist())]) for j, (expert, piece) in\n"
     "        enumerate(zip(local_experts, pieces, strict=True))])\n"),
]}
