"""Runs lesson 03's ``setup`` (task3_2) under a real launcher, for the lesson's tests.

    torchrun --standalone --nproc-per-node=2 lessons/03_ddp/check_setup.py
    python lessons/03_ddp/check_setup.py --bad-environments

Under torchrun every rank calls ``setup()``, checks the group with an all-reduce, and
rank 0 reports what every rank returned. With ``--bad-environments`` it tries environments a
launcher should never produce and reports the error raised for each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, for the harness
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.exercises import load_exercise  # noqa: E402
from harness.launch import free_port  # noqa: E402


def under_launcher(ex) -> dict:
    info = ex.setup()
    total = torch.ones(1, device=info.device) * (info.rank + 1)
    dist.all_reduce(total)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {
        **{k: (str(v) if isinstance(v, torch.device) else v) for k, v in info._asdict().items()},
        "all_reduce": total.item(), "backend_in_use": dist.get_backend(),
        "current_cuda_device": torch.cuda.current_device() if info.device.type == "cuda" else None,
    })
    dist.destroy_process_group()
    return {"ranks": gathered}


def bad_environments(ex) -> dict:
    full = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    two_local = {**full, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    one_gpu = [mock.patch("torch.cuda.is_available", return_value=True),
               mock.patch("torch.cuda.device_count", return_value=1)]
    # "Without a GPU" must hold on the GPU machine too, where the real answer would be yes.
    no_gpu = [mock.patch("torch.cuda.is_available", return_value=False),
              mock.patch("torch.cuda.device_count", return_value=0)]
    cases = {
        "no launcher": ({}, "auto", []),
        "only RANK and WORLD_SIZE": ({"RANK": "0", "WORLD_SIZE": "2"}, "auto", []),
        "nccl without a GPU": (full, "nccl", no_gpu),
        "nccl with 2 local ranks and 1 GPU": (two_local, "nccl", one_gpu),
        "auto on this machine, world of one": (full, "auto", []),
    }
    report = {}
    for name, (env, backend, patches) in cases.items():
        for key in (*ex.LAUNCHER_VARIABLES, "LOCAL_WORLD_SIZE"):  # the optional one too
            os.environ.pop(key, None)
        os.environ.update(env)
        for patch in patches:
            patch.start()
        try:
            info = ex.setup(backend)
            report[name] = {"returned": {k: str(v) for k, v in info._asdict().items()},
                            "group": dist.is_initialized()}
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the error is what we report
            report[name] = {"error": type(exc).__name__, "message": str(exc)}
        finally:
            for patch in patches:
                patch.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bad-environments", action="store_true")
    parser.add_argument("--result", type=Path)
    args = parser.parse_args()
    ex = load_exercise("03_ddp")  # your file, or the solution under --solutions
    report = bad_environments(ex) if args.bad_environments else under_launcher(ex)
    if args.result and int(os.environ.get("RANK", 0)) == 0:
        args.result.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
