"""Checks only that the features divide: 6 heads of 4 features on 4 ranks give 1.5 heads each."""

TASK = "task6_3"
EXPECT = r"TensorParallelAttention accepted a size of 6 on 4 ranks"


class TensorParallelAttention(CausalSelfAttention):
    def __init__(self, attn, group=None):
        nn.Module.__init__(self)
        self.head_dim, self.dropout, self.resid_drop = attn.head_dim, attn.dropout, attn.resid_drop
        self.q_proj, self.k_proj, self.v_proj = (
            ColumnParallelLinear(proj, group, copy_input=False)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.out_proj = RowParallelLinear(attn.out_proj, group)
        self.group = group

    def forward(self, x):
        return super().forward(copy_to_parallel(x, self.group))
