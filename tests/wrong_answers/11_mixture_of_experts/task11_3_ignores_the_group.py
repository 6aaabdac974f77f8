"""AllToAll exchanges over every rank, whatever group it was given."""

TASK = "task11_3"
EXPECT = r"pass group= to all_to_all_single"
REPLACE = {"AllToAll": [
    ("                               input_split_sizes=send_sizes, group=group)\n",
     "                               input_split_sizes=send_sizes)\n"),
]}
