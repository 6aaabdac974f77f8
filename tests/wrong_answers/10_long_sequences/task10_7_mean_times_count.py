"""Gets each rank's sum as its mean times its count: on a rank without real tokens the mean is
0/0, NaN, and NaN times 0 is still NaN, which the all-reduce spreads to every rank."""

TASK = "task10_7"
EXPECT = r"NaN or inf"
REPLACE = {"token_mean_loss": [
    ("""    mine = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")
    real = (targets != ignore_index).sum()
""", """    real = (targets != ignore_index).sum()
    mine = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index) * real
"""),
]}
