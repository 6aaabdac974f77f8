"""ColwiseParallel for every layer: out_proj's output is a slice, the residual add fails."""

TASK = "task6_4"
EXPECT = r"the forward of the running example split by parallelize_gpt failed.*end whole"


def block_plan():
    return {"attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                       desired_input_layouts=(Replicate(),),
                                       use_local_output=False),
            **{f"attn.{name}": ColwiseParallel()
               for name in ("q_proj", "k_proj", "v_proj", "out_proj")},
            "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": ColwiseParallel()}
