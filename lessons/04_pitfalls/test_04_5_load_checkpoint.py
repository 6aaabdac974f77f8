"""Lesson 04, task4_5: ``load_checkpoint(path, model, device)``: a DDP checkpoint saved on cuda:0
loads on the CPU (map_location), its leading ``module.`` stripped once, plain keys left
alone, strict about missing and unexpected keys, and weights_only=True. Plain calls, no ranks.

    pytest lessons/04_pitfalls -m task4_5
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.compare import assert_parameters_close
from lesson04.common import lab, runtime_error_from

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task4_5": {
        "torch.load(path, map_location=device, ...)":
            ["test_load_checkpoint_maps_devices_and_strips_prefixes"],
        "weights_only=True": ["test_load_checkpoint_refuses_a_checkpoint_that_runs_code"],
        "strip a leading module. from the keys":
            ["test_load_checkpoint_maps_devices_and_strips_prefixes",
             "test_load_checkpoint_strips_only_the_leading_prefix"],
        "keys without it are left alone":
            ["test_load_checkpoint_accepts_plain_keys_and_rejects_wrong_ones"],
        "strict: a missing key is an error":
            ["test_load_checkpoint_accepts_plain_keys_and_rejects_wrong_ones"],
        "strict: an unexpected key is an error":
            ["test_load_checkpoint_rejects_an_unexpected_key"],
        "return model": ["test_load_checkpoint_maps_devices_and_strips_prefixes"],
    },
}


@pytest.mark.task4_5
def test_load_checkpoint_maps_devices_and_strips_prefixes(ex, tmp_path, monkeypatch):
    """A checkpoint with `module.` keys whose tensors are recorded on `cuda:0` loads on a CPU:
    `torch.load` is given a `map_location`, and the returned model holds the saved weights."""
    torch.manual_seed(0)
    trained = nn.Linear(4, 2)
    path = tmp_path / "ddp.pt"
    with lab("09_checkpoints").written_on_cuda0():  # as saved by a process on cuda:0
        torch.save({f"module.{k}": v for k, v in trained.state_dict().items()}, path)
    seen = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        seen.append(kwargs.get("map_location", args[1] if len(args) > 1 else None))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    try:
        model = ex.load_checkpoint(path, nn.Linear(4, 2), torch.device("cpu"))
    except NotImplementedError:
        raise
    except RuntimeError as error:
        if "CUDA" in str(error):
            raise AssertionError(f"torch.load without map_location put the tensors back on "
                                 f"cuda:0: pass map_location=device. ({error})") from None
        raise AssertionError(f"loading a DDP checkpoint failed: strip the leading 'module.' "
                             f"from every key. ({' '.join(str(error).split())[:300]})") from None
    assert seen and seen[0] is not None, "call torch.load with map_location=device"
    assert isinstance(model, nn.Module), "return the model"
    assert_parameters_close(model, trained, what="loaded parameter")


@pytest.mark.task4_5
def test_load_checkpoint_accepts_plain_keys_and_rejects_wrong_ones(ex, tmp_path):
    """A checkpoint with plain keys loads unchanged, and one without `bias` raises a RuntimeError
    that names it (strict loading)."""
    torch.manual_seed(0)
    trained = nn.Linear(4, 2)
    plain = tmp_path / "plain.pt"
    torch.save(trained.state_dict(), plain)
    try:
        loaded = ex.load_checkpoint(plain, nn.Linear(4, 2), torch.device("cpu"))
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(
            f"loading a plain checkpoint (keys 'weight', 'bias', no 'module.') failed: remove "
            f"the prefix only from keys that start with it, key.removeprefix('module.'). "
            f"({type(error).__name__}: {' '.join(str(error).split())[:300]})") from None
    assert_parameters_close(loaded, trained, what="parameter loaded from a plain checkpoint")
    wrong = tmp_path / "wrong.pt"
    torch.save({"module.weight": trained.weight.detach()}, wrong)  # no bias
    error = runtime_error_from(lambda: ex.load_checkpoint(wrong, nn.Linear(4, 2),
                                                          torch.device("cpu")),
                               "load_state_dict is strict: a missing 'bias' is an error")
    assert "bias" in str(error), f"the error should name the missing key: {error}"


CODE_RAN: list[str] = []  # what the checkpoint below ran when it was unpickled


def code_run_by_unpickling(state: dict) -> dict:
    CODE_RAN.append("ran")
    return state


class RunsCodeWhenLoaded:
    """Pickled as a call to code_run_by_unpickling: any function a file names runs when
    ``torch.load(..., weights_only=False)`` unpickles it."""

    def __init__(self, state: dict):
        self.state = state

    def __reduce__(self):
        return code_run_by_unpickling, (self.state,)


@pytest.mark.task4_5
def test_load_checkpoint_refuses_a_checkpoint_that_runs_code(ex, tmp_path):
    """A checkpoint that calls a function when it is unpickled is refused, and the function never
    runs (`weights_only=True`)."""
    torch.manual_seed(0)
    state = {f"module.{k}": v for k, v in nn.Linear(4, 2).state_dict().items()}
    path = tmp_path / "runs_code.pt"
    torch.save(RunsCodeWhenLoaded(state), path)
    CODE_RAN.clear()
    try:
        ex.load_checkpoint(path, nn.Linear(4, 2), torch.device("cpu"))
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - refusing the file, however it says so, is right
        refused = True
    else:
        refused = False
    assert not CODE_RAN, (
        "load_checkpoint ran a function named in the checkpoint file: torch.load with "
        "weights_only=False unpickles anything, and unpickling can call any function. Pass "
        "weights_only=True: it loads tensors and plain containers only")
    assert refused, ("load_checkpoint loaded a checkpoint holding more than tensors and plain "
                     "containers: torch.load(..., weights_only=True) refuses it")


@pytest.mark.task4_5
def test_load_checkpoint_rejects_an_unexpected_key(ex, tmp_path):
    """A checkpoint with one key too many, `module.scale`, raises a RuntimeError that names `scale`.
    """
    torch.manual_seed(0)
    trained = nn.Linear(4, 2)
    extra = tmp_path / "extra.pt"
    torch.save({**{f"module.{k}": v for k, v in trained.state_dict().items()},
                "module.scale": torch.ones(2)}, extra)
    error = runtime_error_from(
        lambda: ex.load_checkpoint(extra, nn.Linear(4, 2), torch.device("cpu")),
        "load_state_dict is strict: an unexpected key 'scale' is an error too (a checkpoint "
        "of another model)")
    assert "scale" in str(error), f"the error should name the unexpected key 'scale': {error}"


class Wrapper(nn.Module):
    """A model whose own submodule is called ``module``: its plain keys start with 'module.'."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 2)


@pytest.mark.task4_5
def test_load_checkpoint_strips_only_the_leading_prefix(ex, tmp_path):
    """The DDP checkpoint of a model whose own submodule is called `module` (keys
    `module.module.weight`, ...) loads: only the leading `module.` is stripped."""
    torch.manual_seed(0)
    trained = Wrapper()
    path = tmp_path / "ddp_of_wrapper.pt"
    torch.save({f"module.{k}": v for k, v in trained.state_dict().items()}, path)
    try:
        loaded = ex.load_checkpoint(path, Wrapper(), torch.device("cpu"))
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(
            f"loading the DDP checkpoint of a model whose own submodule is called 'module' "
            f"(keys {sorted(f'module.{k}' for k in trained.state_dict())}) failed: strip the "
            f"leading 'module.' once, not every 'module.' in the key: "
            f"key.removeprefix('module.'). ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]})") from None
    assert_parameters_close(loaded, trained, what="parameter of a model with a submodule "
                                                  "called 'module'")
