"""AllGatherSequence gathers over every rank, whatever group it was given."""

TASK = "task10_1"
EXPECT = r"not for the group's 2: pass group="
REPLACE = {"AllGatherSequence": [
    ("        whole = mine.new_empty((dist.get_world_size(group) * mine.shape[0], "
     "*mine.shape[1:]))\n"
     "        all_gather_single(whole, mine, group=group)\n",
     "        whole = mine.new_empty((dist.get_world_size() * mine.shape[0], *mine.shape[1:]))\n"
     "        all_gather_single(whole, mine)\n"),
]}
