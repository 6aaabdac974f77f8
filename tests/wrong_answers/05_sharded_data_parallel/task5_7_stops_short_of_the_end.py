"""Gives no forward list to the blocks with fewer than forward blocks after them (a loop that
breaks at len(blocks) - forward, as a tutorial writes it): harmless while an earlier block has
started the last ones, but with forward at least the number of blocks no block starts any."""

TASK = "task5_7"
EXPECT = r"when block 0's forward began, blocks \[0\] had been all-gathered; expected \[0, 1, 2\]"
REPLACE = {"prefetch": [
    ("        block.set_modules_to_forward_prefetch(list(blocks[i + 1:i + 1 + forward]))\n",
     "        if i < len(blocks) - forward:\n"
     "            block.set_modules_to_forward_prefetch(list(blocks[i + 1:i + 1 + forward]))\n"),
]}
