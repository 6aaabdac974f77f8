"""Wraps the blocks with the reentrant checkpoint, the variant torch takes when use_reentrant is
not passed: it works until a block's input needs no gradient (frozen embeddings), and then
gives that block's parameters none."""

TASK = "task5_6"
EXPECT = r"with the embeddings frozen.*got no gradient.*reentrant"
REPLACE = {"checkpoint_blocks": [
    ("    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n",
     "    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
     "        CheckpointImpl,\n"
     "        checkpoint_wrapper,\n"
     "    )\n"),
    ("        model.blocks[index] = checkpoint_wrapper(model.blocks[index])\n",
     "        model.blocks[index] = checkpoint_wrapper(model.blocks[index],\n"
     "                                                 checkpoint_impl=CheckpointImpl.REENTRANT)\n"),
]}
