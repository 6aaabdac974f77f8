"""Pads the group's flat total to a multiple of the world size, as a flat-parameter FSDP (or
lesson 05's ZeRO) would: FSDP2 pads each parameter along its own first dimension."""

TASK = "task8_6"
EXPECT = r"padded on its own"
REPLACE = {"fsdp_step_collectives": [
    ("        numel = sum(padded_numel(shape) for shape in shapes)\n",
     "        numel = -(-sum(math.prod(shape) for shape in shapes) // world_size) * world_size\n"),
]}
