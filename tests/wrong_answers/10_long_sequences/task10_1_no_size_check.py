"""ReduceScatterSequence never checks that the tokens divide among the ranks: torch fails deep
inside, or cuts unevenly."""

TASK = "task10_1"
EXPECT = r"raise a ValueError before any collective|not a ValueError"
REPLACE = {"ReduceScatterSequence": [
    ("        if x.shape[dim] % world:\n"
     "            raise ValueError(f\"the sequence's {x.shape[dim]} tokens (dimension {dim}) "
     "do not \"\n"
     "                             f\"divide among {world} ranks\")\n",
     ""),
]}
