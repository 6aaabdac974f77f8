"""Returns on every rank as soon as the generators are gathered: rank 1 goes on (loads the step,
or ends the job) while rank 0 is still writing it."""

TASK = "task9_1"
EXPECT = r"rank 1 returned from save_training_state while rank 0 was still writing"


def save_training_state(path: str | os.PathLike, model: nn.Module, optimizer, scheduler, scaler,
                        position: Mapping) -> None:
    path = Path(path)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, rng_state())  # every rank's, in rank order
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # an earlier crash's leftovers
        partial.mkdir(parents=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "position": dict(position), "generators": generators},
                   partial / TRAIN_STATE)
        sync_to_disk(partial / TRAIN_STATE)  # the bytes, then the name, before the rename
        sync_to_disk(partial)
        if path.exists():  # saved before a restart: a rename cannot replace a full directory
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old)
        else:
            os.replace(partial, path)  # one rename: the checkpoint appears whole, or not at all
        sync_to_disk(path.parent)  # the rename itself, on the disk
