"""Splits with torch.chunk, which can make fewer than m micro-batches (6 in 4 gives 3 of 2)."""

TASK = "task2_2"
EXPECT = r"use torch\.tensor_split\(inputs, m\), which makes exactly m"


def pipelined_step(model, inputs, targets, loss_fn, num_micro_batches):
    batch_size = inputs.shape[0]
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(f"num_micro_batches must be between 1 and {batch_size}")
    losses = []
    for x, y in zip(torch.chunk(inputs, num_micro_batches),
                    torch.chunk(targets, num_micro_batches), strict=True):
        output = model(x)
        losses.append(loss_fn(output, y.to(output.device)) * (x.shape[0] / batch_size))
    loss = torch.stack(losses).sum()
    loss.backward()
    return loss.item()
