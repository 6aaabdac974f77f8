"""Does not check that the experts split into equal blocks: 3 experts on 2 ranks go unnoticed
until the all-to-all's sizes are wrong."""

TASK = "task11_2"
EXPECT = r"DID NOT RAISE"
REPLACE = {"dispatch_plan": [
    ("    if num_experts % world_size:\n"
     "        raise ValueError(f\"{num_experts} experts do not split into equal blocks on \"\n"
     "                         f\"{world_size} ranks\")\n", ""),
]}
