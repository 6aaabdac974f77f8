"""Puts the mirrored chunk first: rank r holds chunk 2W-1-r, then chunk r."""

TASK = "task10_4"
EXPECT = r"wrong way round"
REPLACE = {"zigzag_split": [
    ("torch.cat([pieces[r], pieces[chunks - 1 - r]], dim=dim)",
     "torch.cat([pieces[chunks - 1 - r], pieces[r]], dim=dim)"),
]}
