"""Passes the size lists on as they came: sizes given as tensors (a row of exchange_counts'
result) reach all_to_all_single, which takes only sequences of ints."""

TASK = "task11_3"
EXPECT = r"sizes may come as int64 tensors"
REPLACE = {"AllToAll": [
    ("        send_sizes, receive_sizes = [int(n) for n in send_sizes], [int(n) for n in "
     "receive_sizes]\n", ""),
]}
