"""fsyncs the file and its directory before the rename, but not the checkpoints folder after it:
the rename itself can be lost with the power."""

TASK = "task9_1"
EXPECT = r"checkpoints folder was not fsynced after the rename"


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
        if path.exists():
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old)
        else:
            os.replace(partial, path)
    dist.barrier()
