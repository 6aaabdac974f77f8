"""Calls model.zero_grad() first, so the gradients already there are thrown away, not added to."""

TASK = "task2_2"
EXPECT = r"(?i)accumulate like backward, do not zero"


def pipelined_step(model, inputs, targets, loss_fn, num_micro_batches):
    batch_size = inputs.shape[0]
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(f"num_micro_batches must be between 1 and {batch_size}")
    model.zero_grad()
    losses = []
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches),
                    torch.tensor_split(targets, num_micro_batches), strict=True):
        output = model(x)
        losses.append(loss_fn(output, y.to(output.device)) * (x.shape[0] / batch_size))
    loss = torch.stack(losses).sum()
    loss.backward()
    return loss.item()
