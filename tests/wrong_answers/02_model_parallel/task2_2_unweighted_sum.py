"""Adds up the micro-batches' mean losses without any weight, so the gradient is m times too big."""

TASK = "task2_2"
EXPECT = r"wrong loss scaling: the micro-batch mean losses were added without weights"


def pipelined_step(model, inputs, targets, loss_fn, num_micro_batches):
    batch_size = inputs.shape[0]
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(f"num_micro_batches must be between 1 and {batch_size}")
    losses = []
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches),
                    torch.tensor_split(targets, num_micro_batches), strict=True):
        output = model(x)
        losses.append(loss_fn(output, y.to(output.device)))
    loss = torch.stack(losses).sum()
    loss.backward()
    return loss.item()
