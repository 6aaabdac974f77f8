"""Exchanges with the dimensions the wrong way round: cuts the tokens and joins the heads
(dims 2, 1) going in, and the reverse coming out."""

TASK = "task10_6"
EXPECT = r"valid inputs, since\s+the heads|ulysses_attention's out"
REPLACE = {"ulysses_attention": [
    ("    q, k, v = (SeqAllToAll.apply(t, 1, 2, group) for t in (q, k, v))",
     "    q, k, v = (SeqAllToAll.apply(t, 2, 1, group) for t in (q, k, v))"),
    ("    return SeqAllToAll.apply(out, 2, 1, group)",
     "    return SeqAllToAll.apply(out, 1, 2, group)"),
]}
