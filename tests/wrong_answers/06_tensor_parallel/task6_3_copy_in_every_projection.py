"""q, k and v each copy their input: right gradients, but three all-reduces where one does."""

TASK = "task6_3"
EXPECT = r"the backward of 2 split blocks ran 8 collectives.*copy_input=False"


class TensorParallelAttention(CausalSelfAttention):
    def __init__(self, attn, group=None):
        nn.Module.__init__(self)
        heads = attn.q_proj.out_features // attn.head_dim
        split_size(heads, dist.get_world_size(group), "n_head")
        self.head_dim, self.dropout, self.resid_drop = attn.head_dim, attn.dropout, attn.resid_drop
        self.q_proj, self.k_proj, self.v_proj = (
            ColumnParallelLinear(proj, group) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.out_proj = RowParallelLinear(attn.out_proj, group)
        self.group = group

    def forward(self, x):
        return super().forward(x)
