"""Saves only rank 0's generator states, and every rank restores them: rank 1 then draws rank
0's dropout masks after a resume."""

TASK = "task9_1"
EXPECT = r"rank 1: torch's generator after loading is not the one this rank had when it saved; " \
         r"it is rank 0's"


def save_training_state(path, model, optimizer, scheduler, scaler, position):
    path = Path(path)
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        generators = [rng_state()] * dist.get_world_size()  # rank 0's, for every rank
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "position": dict(position), "generators": generators},
                   partial / TRAIN_STATE)
        os.replace(partial, path)
    dist.barrier()
