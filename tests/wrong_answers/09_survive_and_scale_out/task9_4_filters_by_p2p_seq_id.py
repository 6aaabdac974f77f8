"""Tells sends and receives by a non-zero p2p_seq_id: every entry after a rank's first send
carries one, collectives too, so the rest of that rank's collectives are skipped."""

TASK = "task9_4"
EXPECT = r"sends and receives, numbered"
REPLACE = {"first_mismatch": [
    ('            operation = entry["profiling_name"].split(":", 1)[-1].split(" ")[0]\n'
     '            if operation in ("send", "recv"):  # point-to-point: numbered apart\n'
     '                continue\n',
     '            if entry["p2p_seq_id"]:  # a send or a receive\n'
     '                continue\n'),
]}
