"""Weighs every micro-batch's mean loss by 1/m, which is wrong when the micro-batches differ in size."""

TASK = "task2_2"
EXPECT = r"wrong loss scaling: weighting each micro-batch's mean loss by 1/m"


def pipelined_step(model, inputs, targets, loss_fn, num_micro_batches):
    batch_size = inputs.shape[0]
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(f"num_micro_batches must be between 1 and {batch_size}")
    losses = []
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches),
                    torch.tensor_split(targets, num_micro_batches), strict=True):
        output = model(x)
        losses.append(loss_fn(output, y.to(output.device)) / num_micro_batches)
    loss = torch.stack(losses).sum()
    loss.backward()
    return loss.item()
