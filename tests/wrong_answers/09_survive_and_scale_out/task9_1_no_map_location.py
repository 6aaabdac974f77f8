"""Loads train.pt without its map_location: fine on the CPU, but on GPUs every rank's tensors
land on the device they were saved from, cuda:0."""

TASK = "task9_1"
EXPECT = r"called torch.load with map_location None"


def load_training_state(path: str | os.PathLike, model: nn.Module, optimizer, scheduler, scaler,
                        map_location: str | torch.device = "cpu") -> dict:
    state = torch.load(Path(path) / TRAIN_STATE, weights_only=True)
    written_by, world_size = len(state["generators"]), dist.get_world_size()
    if written_by != world_size:
        raise ValueError(f"{path} was written by {written_by} ranks; this run has "
                         f"{world_size}: each rank needs its own generator states")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["generators"][dist.get_rank()])
    return state["position"]
