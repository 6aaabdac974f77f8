"""Runs each micro-batch's backward right after its forward (gradient accumulation, not GPipe)."""

TASK = "task2_2"
EXPECT = r"GPipe runs the forward of every micro-batch first"


def pipelined_step(model, inputs, targets, loss_fn, num_micro_batches):
    batch_size = inputs.shape[0]
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(f"num_micro_batches must be between 1 and {batch_size}")
    total = 0.0
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches),
                    torch.tensor_split(targets, num_micro_batches), strict=True):
        output = model(x)
        loss = loss_fn(output, y.to(output.device)) * (x.shape[0] / batch_size)
        loss.backward()
        total += loss.item()
    return total
