"""Gathers along the first dimension whatever dim says: the batch grows instead of the
sequence."""

TASK = "task10_1"
EXPECT = r"AllGatherSequence's output \(dim=-?[12]\): shape"
REPLACE = {"AllGatherSequence": [
    ("        mine = x.movedim(dim, 0).contiguous()  # the collectives cut along the first "
     "dimension\n",
     "        mine = x.contiguous()\n"),
    ("        return whole.movedim(0, dim)\n", "        return whole\n"),
]}
