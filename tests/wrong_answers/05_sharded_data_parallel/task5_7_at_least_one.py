"""Treats forward=0 as "the default" and gives every block one block ahead anyway (the default
of this function, not FSDP's): forward=0 must start none ahead."""

TASK = "task5_7"
EXPECT = r"forward=0, backward=0\): when block 0's forward began, blocks \[0, 1\] had been"
REPLACE = {"prefetch": [
    ("list(blocks[i + 1:i + 1 + forward])", "list(blocks[i + 1:i + 1 + max(forward, 1)])"),
]}
