"""Saves the model, the optimizer and the scaler but not the learning-rate scheduler: the
resumed run starts its schedule again, with the first step's learning rate."""

TASK = "task9_1"
EXPECT = r"the scheduler after loading is at step 0, the run was at 5"


def save_training_state(path, model, optimizer, scheduler, scaler, position):
    path = Path(path)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, rng_state())
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "position": dict(position),
                    "generators": generators}, partial / TRAIN_STATE)
        os.replace(partial, path)
    dist.barrier()


def load_training_state(path, model, optimizer, scheduler, scaler, map_location="cpu"):
    state = torch.load(Path(path) / TRAIN_STATE, map_location=map_location, weights_only=True)
    if len(state["generators"]) != dist.get_world_size():
        raise ValueError(f"{len(state['generators'])} ranks, not {dist.get_world_size()}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["generators"][dist.get_rank()])
    return state["position"]
