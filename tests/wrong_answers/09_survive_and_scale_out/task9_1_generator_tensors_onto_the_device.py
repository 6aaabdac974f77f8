"""Saves torch's generator state as the tensor torch returns and restores it as loaded: fine on a
CPU, but map_location moves it onto the GPU, where torch.set_rng_state refuses it."""

import random

TASK = "task9_1"
EXPECT = r"map_location='meta'\) raised .*set_rng_state"


def save_training_state(path, model, optimizer, scheduler, scaler, position):
    path = Path(path)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, {"torch": torch.get_rng_state(),
                                        "python": random.getstate()})
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
        sync_to_disk(path.parent)
    dist.barrier()


def load_training_state(path, model, optimizer, scheduler, scaler, map_location="cpu"):
    state = torch.load(Path(path) / TRAIN_STATE, map_location=map_location, weights_only=True)
    if len(state["generators"]) != dist.get_world_size():
        raise ValueError(f"{path} was written by {len(state['generators'])} ranks; this run has "
                         f"{dist.get_world_size()}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    mine = state["generators"][dist.get_rank()]
    torch.set_rng_state(mine["torch"])
    random.setstate(mine["python"])
    return state["position"]
