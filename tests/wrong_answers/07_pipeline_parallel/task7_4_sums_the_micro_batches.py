"""Turns off torch's averaging over micro-batches (scale_grads=False): gradients m times too big."""

TASK = "task7_4"
EXPECT = r"it is \d(\.\d+)?x the whole batch's"


def torch_schedule(module, stage, num_stages, num_micro_batches, loss_fn, device, kind="1f1b"):
    pipeline_stage = PipelineStage(module, stage, num_stages, device)
    schedule_class = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[kind]
    return schedule_class(pipeline_stage, n_microbatches=num_micro_batches, loss_fn=loss_fn,
                          scale_grads=False)
