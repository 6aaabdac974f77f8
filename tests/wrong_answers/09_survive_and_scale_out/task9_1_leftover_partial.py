"""Creates <path>.partial with mkdir(parents=True) and never clears what a crashed save left:
the next save of the same step fails with FileExistsError."""

TASK = "task9_1"
EXPECT = r"saving again after a crashed save failed: FileExistsError"


def save_training_state(path, model, optimizer, scheduler, scaler, position):
    path = Path(path)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, rng_state())
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        partial.mkdir(parents=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "position": dict(position), "generators": generators},
                   partial / TRAIN_STATE)
        os.replace(partial, path)
    dist.barrier()
