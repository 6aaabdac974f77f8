"""Counts every collective a rank no longer holds as missed: a full buffer's dropped entries
become a divergence that never happened."""

TASK = "task9_4"
EXPECT = r"buffer dropped collectives 1 to 3"
REPLACE = {"first_mismatch": [
    ('                if recorded and seq < min(recorded):\n'
     "                    continue  # dropped from this rank's buffer: unknown\n",
     ''),
]}
