"""Turns off preserve_rng_state to save the generator's stash and restore: the recomputation
then draws new dropout masks, so the backward differentiates another forward than the one that
made the loss."""

TASK = "task5_6"
EXPECT = r"the gradient of .* differs from the unwrapped model's.*other dropout masks"
REPLACE = {"checkpoint_blocks": [
    ("        model.blocks[index] = checkpoint_wrapper(model.blocks[index])\n",
     "        model.blocks[index] = checkpoint_wrapper(model.blocks[index],\n"
     "                                                 preserve_rng_state=False)\n"),
]}
