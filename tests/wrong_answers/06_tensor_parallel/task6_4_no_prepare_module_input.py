"""A plan of ColwiseParallel and RowwiseParallel only: q, k and v each all-reduce in backward."""

TASK = "task6_4"
EXPECT = r"PrepareModuleInput"


def block_plan():
    return {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
            "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
