"""Reduce-scatters the gradients in the parameters' dtype even when the policy gives an fp32
reduce_dtype."""

TASK = "task8_6"
EXPECT = r"reduce-scatters of 4"
REPLACE = {"fsdp_step_collectives": [
    ('        collectives.append(("reduce_scatter", numel * reduce_bytes))\n',
     '        collectives.append(("reduce_scatter", numel * param_bytes))\n'),
]}
