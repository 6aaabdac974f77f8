"""Writes into .partial and renames, but never fsyncs: after a power loss the renamed
directory can hold a short file (the rename reached the disk before the data did)."""

TASK = "task9_1"
EXPECT = r"train\.pt was not fsynced before the rename"


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
        if path.exists():
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old)
        else:
            os.replace(partial, path)
    dist.barrier()
