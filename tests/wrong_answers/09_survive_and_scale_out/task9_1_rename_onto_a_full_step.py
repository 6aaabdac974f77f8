"""Renames the .partial directory onto the step's name even when a copy of that step is already
there: os.replace refuses a directory that is not empty, so a restart fails at every retry."""

TASK = "task9_1"
EXPECT = r"where a broken copy of it already was failed: OSError"


def save_training_state(path, model, optimizer, scheduler, scaler, position):
    path = Path(path)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, rng_state())
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "position": dict(position), "generators": generators},
                   partial / TRAIN_STATE)
        sync_to_disk(partial / TRAIN_STATE)
        sync_to_disk(partial)
        os.replace(partial, path)
        sync_to_disk(path.parent)
    dist.barrier()
