"""Builds ScheduleGPipe whatever kind is asked for."""

TASK = "task7_4"
EXPECT = r"torch_schedule\(kind='1f1b'\) made a ScheduleGPipe, not Schedule1F1B"


def torch_schedule(module, stage, num_stages, num_micro_batches, loss_fn, device, kind="1f1b"):
    pipeline_stage = PipelineStage(module, stage, num_stages, device)
    return ScheduleGPipe(pipeline_stage, n_microbatches=num_micro_batches, loss_fn=loss_fn)
