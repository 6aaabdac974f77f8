"""Writes train.pt straight into the checkpoint directory: a crash half-way leaves a directory
that looks like the newest checkpoint, holding a file cut short."""

TASK = "task9_1"
EXPECT = r"the crash left step-00000003 behind, with a file cut short"


def save_training_state(path, model, optimizer, scheduler, scaler, position):
    path = Path(path)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, rng_state())
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "position": dict(position), "generators": generators}, path / TRAIN_STATE)
    dist.barrier()
