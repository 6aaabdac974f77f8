"""Never checks that the length divides by 2W: chunk() quietly makes uneven chunks."""

TASK = "task10_4"
EXPECT = r"without an error"
REPLACE = {"zigzag_split": [
    ("    if x.shape[dim] % chunks:\n"
     "        raise ValueError(f\"a sequence of {x.shape[dim]} tokens does not cut into "
     "{chunks} \"\n"
     "                         f\"equal chunks (2 per rank for {world_size} ranks)\")\n",
     ""),
]}
