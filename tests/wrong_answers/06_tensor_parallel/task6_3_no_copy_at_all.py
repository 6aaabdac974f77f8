"""copy_input=False on q, k and v, and no copy_to_parallel in forward: f is missing."""

TASK = "task6_3"
EXPECT = r"only its own heads. or features. part .*copy_to_parallel \(f\) .* is missing"


class TensorParallelAttention(CausalSelfAttention):
    def __init__(self, attn, group=None):
        nn.Module.__init__(self)
        heads = attn.q_proj.out_features // attn.head_dim
        split_size(heads, dist.get_world_size(group), "n_head")
        self.head_dim, self.dropout, self.resid_drop = attn.head_dim, attn.dropout, attn.resid_drop
        self.q_proj, self.k_proj, self.v_proj = (
            ColumnParallelLinear(proj, group, copy_input=False)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.out_proj = RowParallelLinear(attn.out_proj, group)
        self.group = group

    def forward(self, x):
        return super().forward(x)
