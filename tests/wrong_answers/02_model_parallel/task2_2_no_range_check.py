"""Does not check 1 <= num_micro_batches <= batch size, so m = 11 for 10 samples runs on an empty micro-batch."""

TASK = "task2_2"
EXPECT = r"pipelined_step\(num_micro_batches=(0|-1|11)\) for a batch of 10 .*expected a ValueError"


def pipelined_step(model, inputs, targets, loss_fn, num_micro_batches):
    batch_size = inputs.shape[0]
    losses = []
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches),
                    torch.tensor_split(targets, num_micro_batches), strict=True):
        output = model(x)
        losses.append(loss_fn(output, y.to(output.device)) * (x.shape[0] / batch_size))
    loss = torch.stack(losses).sum()
    loss.backward()
    return loss.item()
