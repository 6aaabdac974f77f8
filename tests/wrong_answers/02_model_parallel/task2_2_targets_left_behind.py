"""Computes each micro-batch's loss with the targets left on the CPU, not on the output's device."""

TASK = "task2_2"
EXPECT = r"move each target micro-batch to its output's device"


def pipelined_step(model, inputs, targets, loss_fn, num_micro_batches):
    batch_size = inputs.shape[0]
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(f"num_micro_batches must be between 1 and {batch_size}")
    losses = []
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches),
                    torch.tensor_split(targets, num_micro_batches), strict=True):
        losses.append(loss_fn(model(x), y) * (x.shape[0] / batch_size))
    loss = torch.stack(losses).sum()
    loss.backward()
    return loss.item()
