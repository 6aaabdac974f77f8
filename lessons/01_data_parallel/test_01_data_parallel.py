"""Lesson 01: grades the hand-made data parallelism and checks the lesson's claims about
``nn.DataParallel``.

    pytest lessons/01_data_parallel               # your exercises, and the lesson's claims
    pytest lessons/01_data_parallel -m task1_6    # one task
    pytest lessons/01_data_parallel -m gpu        # only the checks of the real nn.DataParallel

Without a GPU, ``nn.DataParallel`` does not split anything (it calls the module once), so the
checks of the real thing skip with the hardware they need; the hand-made version is what runs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import LESSONS_DIR, load_exercise, load_lesson_module, task_of
from harness.hardware import cuda_device_count, gpu_marks, needs_gpus
from harness.launch import run_script, start_script

LESSON = "01_data_parallel"

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task1_1": {
        "every chunk holds ceil(batch_size / num_replicas) samples": [
            "test_scatter_sizes_examples", "test_scatter_sizes_match_tensor_chunk_everywhere"],
        "except the last one, which holds what is left": [
            "test_scatter_sizes_examples", "test_scatter_sizes_match_tensor_chunk_everywhere"],
        "there can be fewer chunks than replicas": [
            "test_scatter_sizes_examples", "test_scatter_sizes_match_tensor_chunk_everywhere"],
        "the chunk sizes in order, as ints": ["test_scatter_sizes_examples"],
    },
    "task1_2": {
        "chunk i holds the next scatter_sizes(len(batch), num_replicas)[i] samples": [
            "test_scatter_cuts_consecutive_chunks"],
        "in their original order": ["test_scatter_cuts_consecutive_chunks"],
    },
    "task1_3": {
        "num_replicas copies": ["test_replicate_makes_independent_copies"],
        "the same structure, parameter and buffer values": [
            "test_replicate_makes_independent_copies"],
        "the same training mode as model": ["test_replicate_makes_independent_copies"],
        "its own tensors: no replica is model itself": [
            "test_replicate_makes_independent_copies"],
        "every replica starts with no gradients": ["test_replicate_makes_independent_copies"],
    },
    "task1_4": {
        "join the outputs in replica order, along dim 0": [
            "test_gather_joins_in_order_and_keeps_the_graph"],
        "stay connected to the autograd graph of every output": [
            "test_gather_joins_in_order_and_keeps_the_graph"],
    },
    "task1_5": {
        "add the sum of the replicas' gradients into master's gradients": [
            "test_reduce_gradients_sums_into_the_master"],
        "where a master parameter has no gradient yet it becomes the sum": [
            "test_reduce_gradients_sums_into_the_master"],
        "where it has one, the sum is added to it": ["test_reduce_gradients_sums_into_the_master"],
        "a parameter that no replica has a gradient for is left as it is": [
            "test_reduce_gradients_sums_into_the_master"],
        "do not change the replicas": ["test_reduce_gradients_sums_into_the_master"],
    },
    "task1_6": {
        "run replica i on chunk i (model itself never sees the whole batch)": [
            "test_data_parallel_step_equals_one_device"],
        "model's gradients are what loss_fn(model(inputs), targets).backward() would leave": [
            "test_data_parallel_step_equals_one_device"],
        "accumulated onto any gradients already there": [
            "test_data_parallel_step_accumulates_like_backward"],
        "its parameters are unchanged": ["test_data_parallel_step_equals_one_device"],
        "return the whole batch's loss as a float, even when the chunks are uneven": [
            "test_data_parallel_step_equals_one_device"],
    },
}


@pytest.fixture(scope="module")
def ex():
    return load_exercise(LESSON)


@pytest.fixture(scope="module")
def train():
    """The lesson's train.py, imported (the same file in both modes)."""
    return load_lesson_module(LESSON, "train")


class TinyNet(nn.Module):
    """A small MLP that records the batch size and device of every forward it runs.

    The record is a list on the class, so every copy of the model writes to it, however the
    copy was made (``copy.deepcopy``, or DataParallel's replicas running in threads).
    ``runners`` records, in the same order, which instance ran: the model itself or a copy.
    """

    calls: list[tuple[int, torch.device]] = []
    runners: list[nn.Module] = []

    def __init__(self, n_in: int = 5, n_hidden: int = 16, n_out: int = 3, seed: int = 0):
        super().__init__()
        self.hidden = nn.Linear(n_in, n_hidden)
        self.out = nn.Linear(n_hidden, n_out)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TinyNet.calls.append((x.shape[0], x.device))
        TinyNet.runners.append(self)
        return self.out(torch.tanh(self.hidden(x)))


@pytest.fixture(autouse=True)
def fresh_call_record():
    clear_call_record()
    yield
    clear_call_record()


def clear_call_record() -> None:
    TinyNet.calls.clear()
    TinyNet.runners.clear()


def make_batch(batch_size: int, classes: bool = False, seed: int = 1):
    """Inputs (B, 5) and targets: (B, 3) for regression, or (B,) class ids for classification."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, 5, generator=g)
    if classes:
        return inputs, torch.randint(0, 3, (batch_size,), generator=g)
    return inputs, torch.randn(batch_size, 3, generator=g)


def chunk_sizes(batch_size: int, num_replicas: int) -> list[int]:
    """The truth: DataParallel's scatter cuts the batch with Tensor.chunk."""
    return [len(c) for c in torch.empty(batch_size).chunk(num_replicas)]


def seen_batch_sizes() -> list[int]:
    return [size for size, _ in TinyNet.calls]


# --------------------------------------------------------------------------------------------
# task1_1: scatter_sizes


@pytest.mark.task1_1
@pytest.mark.parametrize(
    "batch_size, num_replicas, expected",
    [(12, 3, [4, 4, 4]), (10, 3, [4, 4, 2]), (5, 4, [2, 2, 1]), (2, 3, [1, 1]), (7, 1, [7])],
    ids=["12 on 3", "10 on 3", "5 on 4", "2 on 3", "7 on 1"],
)
def test_scatter_sizes_examples(ex, batch_size, num_replicas, expected):
    got = ex.scatter_sizes(batch_size, num_replicas)
    per_chunk = -(-batch_size // num_replicas)
    assert isinstance(got, (list, tuple)) and all(isinstance(s, int) for s in got), (
        f"scatter_sizes({batch_size}, {num_replicas}) returned {got!r}; expected a list of ints"
    )
    assert list(got) == expected, (
        f"scatter_sizes({batch_size}, {num_replicas}) returned {list(got)}; DataParallel sends "
        f"{expected}: every chunk gets ceil({batch_size}/{num_replicas}) = {per_chunk} samples, "
        f"the last one what is left, and devices left over get no chunk at all"
    )


@pytest.mark.task1_1
def test_scatter_sizes_match_tensor_chunk_everywhere(ex):
    wrong = []
    for batch_size in range(1, 41):
        for num_replicas in range(1, 10):
            got = list(ex.scatter_sizes(batch_size, num_replicas))
            expected = chunk_sizes(batch_size, num_replicas)
            if got != expected:
                wrong.append(f"({batch_size}, {num_replicas}): got {got}, expected {expected}")
    assert not wrong, (
        f"scatter_sizes differs from Tensor.chunk (what DataParallel's scatter uses) in "
        f"{len(wrong)} of 360 cases, for example " + "; ".join(wrong[:3])
    )


# --------------------------------------------------------------------------------------------
# task1_2: scatter


@pytest.mark.task1_2
@pytest.mark.parametrize("batch_size, num_replicas", [(12, 3), (10, 3), (5, 4), (2, 3), (9, 1)],
                         ids=["12 on 3", "10 on 3", "5 on 4", "2 on 3", "9 on 1"])
def test_scatter_cuts_consecutive_chunks(ex, batch_size, num_replicas):
    batch = torch.arange(batch_size * 2, dtype=torch.float32).reshape(batch_size, 2)
    chunks = ex.scatter(batch, num_replicas)
    expected = chunk_sizes(batch_size, num_replicas)
    got_sizes = [tuple(c.shape) for c in chunks]
    assert len(chunks) == len(expected), (
        f"scatter(a batch of {batch_size}, {num_replicas}) gave {len(chunks)} chunks of shapes "
        f"{got_sizes}; DataParallel makes {len(expected)} chunks of sizes {expected}"
    )
    start = 0
    for i, (chunk, size) in enumerate(zip(chunks, expected, strict=True)):
        assert_close(chunk, batch[start:start + size],
                     f"chunk {i} of a batch of {batch_size} on {num_replicas} replicas "
                     f"(it should hold samples {start}..{start + size - 1}, in order)")
        start += size


# --------------------------------------------------------------------------------------------
# task1_3: replicate


def model_with_buffers_and_grads(training: bool) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(3))).sum().backward()
    return model.train(training)


@pytest.mark.task1_3
@pytest.mark.parametrize("training", [True, False], ids=["train mode", "eval mode"])
def test_replicate_makes_independent_copies(ex, training):
    model = model_with_buffers_and_grads(training)
    replicas = ex.replicate(model, 3)
    assert len(replicas) == 3, f"replicate(model, 3) returned {len(replicas)} replicas"
    model_tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    seen_storage = {t.data_ptr(): f"the model's {name!r}" for name, t in model_tensors.items()}
    for i, replica in enumerate(replicas):
        assert replica is not model, (
            f"replica {i} is the model itself; every replica must be a copy, or its gradients "
            f"would be counted twice when they are summed back into the model"
        )
        assert type(replica) is type(model), f"replica {i} is a {type(replica).__name__}"
        assert replica.training == model.training, (
            f"replica {i} has training={replica.training}, the model {model.training}: a "
            f"replica runs in the model's mode (copy.deepcopy keeps it; do not call .train() "
            f"or .eval() on the replicas)"
        )
        assert_parameters_close(replica, model, f"replica {i}'s parameter")
        assert_parameters_close(dict(replica.named_buffers()), dict(model.named_buffers()),
                                f"replica {i}'s buffer")
        for name, tensor in {**dict(replica.named_parameters()),
                             **dict(replica.named_buffers())}.items():
            owner = seen_storage.get(tensor.data_ptr())
            assert owner is None, (
                f"replica {i}'s {name!r} shares memory with {owner}: each replica needs its own "
                f"copy (copy.copy shares; copy.deepcopy copies)"
            )
            seen_storage[tensor.data_ptr()] = f"replica {i}'s {name!r}"
        for name, param in replica.named_parameters():
            assert param.requires_grad, f"replica {i}'s {name!r} does not require grad"
            assert param.grad is None, (
                f"replica {i}'s {name!r} already has a gradient; a fresh replica has none, or "
                f"summing the replicas' gradients would add the model's old gradient again"
            )


# --------------------------------------------------------------------------------------------
# task1_4: gather


@pytest.mark.task1_4
@pytest.mark.parametrize("sizes", [[4, 4, 2], [3, 3, 3], [5]], ids=str)
def test_gather_joins_in_order_and_keeps_the_graph(ex, sizes):
    g = torch.Generator().manual_seed(4)
    leaves = [torch.randn(size, 3, generator=g, requires_grad=True) for size in sizes]
    outputs = [leaf * 2.0 for leaf in leaves]  # like a replica's output: part of a graph
    shapes = [tuple(o.shape) for o in outputs]
    expected = torch.cat([o.detach() for o in outputs])
    try:
        gathered = ex.gather(outputs)
    except Exception as err:
        if task_of(err):  # the untouched stub: reported as "not attempted yet"
            raise
        pytest.fail(f"gather(outputs of shapes {shapes}) raised {type(err).__name__}: "
                    f"{str(err).splitlines()[0]}; join the outputs along dim 0 (the batch "
                    f"dimension), one replica's rows after the other's: torch.cat(outputs, dim=0)")
    if isinstance(gathered, torch.Tensor) and gathered.shape != expected.shape:
        stacked = "torch.stack adds a new dimension; " if gathered.dim() == expected.dim() + 1 \
            else ""
        pytest.fail(f"gather(outputs of shapes {shapes}) has shape {tuple(gathered.shape)}, "
                    f"expected {tuple(expected.shape)}: {stacked}join the outputs along dim 0 "
                    f"(the batch dimension), one replica's rows after the other's")
    assert_close(gathered, expected,
                 f"gathered outputs of chunks {sizes} (replica 0's rows first, then replica 1's)")
    assert gathered.grad_fn is not None, (
        "the gathered output is cut off from the replicas' graphs (it has no grad_fn): a "
        "backward from the loss could not reach the replicas. Do not detach or rebuild it."
    )
    weights = torch.randn(expected.shape, generator=g)
    (gathered * weights).sum().backward()
    start = 0
    for i, (leaf, size) in enumerate(zip(leaves, sizes, strict=True)):
        assert leaf.grad is not None, f"no gradient reached replica {i}'s output"
        assert_close(leaf.grad, 2.0 * weights[start:start + size],
                     f"gradient that reached replica {i}'s output")
        start += size


# --------------------------------------------------------------------------------------------
# task1_5: reduce_gradients_into


def diagnose_reduction(got, name, before, replica_grads, expected) -> None:
    """Fail with the mistake's name when ``got`` is what a common wrong reduction gives."""
    if torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        return
    start = 0 if before is None else before
    total = sum(replica_grads)
    n = len(replica_grads)
    mistakes = [
        (start + total / n, f"it is the mean of the {n} replicas' gradients, not their sum: "
                            "each replica's gradient is already its share of the whole batch's "
                            "loss, so DataParallel sums them"),
        (replica_grads[-1] if before is None else None,
         f"it is only replica {n - 1}'s gradient (the last one): each replica overwrote the "
         "previous one's; add every replica's gradient"),
        (before + replica_grads[-1] if before is not None else None,
         f"it is the gradient already there plus only replica {n - 1}'s gradient: add every "
         "replica's gradient"),
        (replica_grads[-1] if before is not None else None,
         f"it is only replica {n - 1}'s gradient (the last one): the master's own gradient and "
         "the other replicas' were overwritten; add every replica's gradient to it"),
        (total if before is not None else None,
         "it is the replicas' sum alone: the gradient already on the master was overwritten; "
         "add the sum to it (param.grad += total), as backward accumulates"),
    ]
    for wrong, why in mistakes:
        if wrong is not None and torch.allclose(got, wrong, rtol=1e-5, atol=1e-6):
            pytest.fail(f"master gradient of {name!r}: {why}")


@pytest.mark.task1_5
@pytest.mark.parametrize("already", [False, True],
                         ids=["master without grads", "master with grads"])
def test_reduce_gradients_sums_into_the_master(ex, already):
    g = torch.Generator().manual_seed(5)
    master = TinyNet()
    replicas = [copy.deepcopy(master) for _ in range(3)]
    for replica in replicas:
        for name, p in replica.named_parameters():
            # 'out.bias' gets no gradient anywhere, like a parameter the forward never used.
            p.grad = None if name == "out.bias" else torch.randn(p.shape, generator=g)
    before = {name: None if p.grad is None else p.grad.clone()
              for name, p in master.named_parameters()}
    if already:
        for name, p in master.named_parameters():
            p.grad = torch.randn(p.shape, generator=g)
            before[name] = p.grad.clone()
    replica_grads = [{n: None if p.grad is None else p.grad.clone()
                      for n, p in r.named_parameters()} for r in replicas]

    try:
        ex.reduce_gradients_into(master, replicas)
    except Exception as err:
        if task_of(err):  # the untouched stub: reported as "not attempted yet"
            raise
        none = ("; in this test 'out.bias' has .grad None on every replica (a parameter the "
                "forward never used): skip the gradients that are None" if "None" in str(err)
                else "")
        pytest.fail(f"reduce_gradients_into raised {type(err).__name__}: "
                    f"{str(err).splitlines()[0]}{none}")

    for name, p in master.named_parameters():
        if name == "out.bias":
            if before[name] is None:
                assert p.grad is None, (
                    "'out.bias' has no gradient on any replica, so the master's must stay None "
                    "(as after a backward that never reached it), not become zeros"
                )
            else:
                assert_close(p.grad, before[name], "master gradient of 'out.bias' (no replica "
                             "has one, so it must be left as it was)")
            continue
        total = sum(grads[name] for grads in replica_grads)
        expected = total if before[name] is None else before[name] + total
        assert p.grad is not None, f"master {name!r} has no gradient after the reduction"
        diagnose_reduction(p.grad, name, before[name], [grads[name] for grads in replica_grads],
                           expected)
        assert_close(p.grad, expected,
                     f"master gradient of {name!r}: the sum of 3 replicas' gradients"
                     + (" added to the gradient already there" if already else ""))
    for i, replica in enumerate(replicas):
        for name, p in replica.named_parameters():
            if replica_grads[i][name] is not None:
                assert_close(p.grad, replica_grads[i][name],
                             f"replica {i}'s gradient of {name!r} (the reduction must not "
                             f"change the replicas; did the master's .grad alias one of them?)")


# --------------------------------------------------------------------------------------------
# task1_6: data_parallel_step: equal to one device


STEP_CASES = [
    pytest.param(12, 3, "mse", id="12 on 3 (even)"),
    pytest.param(10, 3, "mse", id="10 on 3 (4,4,2)"),
    pytest.param(10, 4, "mse", id="10 on 4 (3,3,3,1)"),
    pytest.param(5, 4, "mse", id="5 on 4 (2,2,1: a replica idle)"),
    pytest.param(8, 1, "mse", id="8 on 1"),
    pytest.param(10, 3, "cross_entropy", id="10 on 3 cross-entropy"),
]


def run_step_and_reference(ex, batch_size, num_replicas, loss_name, grads_before=None):
    """data_parallel_step on one model and a plain backward on an identical one."""
    model = TinyNet()
    reference = copy.deepcopy(model)
    if grads_before is not None:
        for net in (model, reference):
            for p in net.parameters():
                p.grad = torch.full_like(p, grads_before)
    inputs, targets = make_batch(batch_size, classes=loss_name == "cross_entropy")
    loss_fn = F.cross_entropy if loss_name == "cross_entropy" else F.mse_loss
    untouched = copy.deepcopy(model)

    loss = ex.data_parallel_step(model, inputs, targets, loss_fn, num_replicas)
    seen = seen_batch_sizes()
    runners = list(TinyNet.runners)
    clear_call_record()
    assert_the_replicas_did_the_work(model, seen, runners, chunk_sizes(batch_size, num_replicas),
                                     f"{batch_size} samples on {num_replicas} replicas")

    reference_loss = loss_fn(reference(inputs), targets)
    reference_loss.backward()
    return model, reference, untouched, loss, reference_loss.item(), seen


def assert_the_replicas_did_the_work(model, seen, runners, sizes, context: str) -> None:
    """Each chunk ran on its own copy of ``model``, once; ``model`` itself ran on nothing.

    Then the model's gradients can only have come from the replicas, summed back into it.
    """
    context = f"{context}, chunks {sizes}"
    by_model = [size for size, who in zip(seen, runners, strict=True) if who is model]
    if by_model:
        idle = len(sizes) - (len(seen) - len(by_model))
        pytest.fail(
            f"the model itself ran on batches of sizes {by_model} ({context}), and "
            f"{idle} of the {len(sizes)} chunks never reached a replica: the replicas were not "
            "used. Did you run the master model on a chunk? Run replica i (from replicate) on "
            "chunk i; the model gets its gradients only from reduce_gradients_into"
        )
    replicas: list[nn.Module] = []
    for who in runners:
        if not any(who is r for r in replicas):
            replicas.append(who)
    for i, replica in enumerate(replicas):  # numbered in the order they first ran
        sizes_run = [size for size, who in zip(seen, runners, strict=True) if who is replica]
        assert len(sizes_run) == 1, (
            f"replica {i} ran {len(sizes_run)} times, on batches of sizes {sizes_run} "
            f"({context}): make one replica per chunk and run each once, on its own chunk"
        )
    assert len(replicas) == len(sizes), (
        f"{len(replicas)} replica(s) ran, on batches of sizes {seen}, for {len(sizes)} chunks "
        f"({context}): each chunk runs on its own replica"
    )


def assert_gradients_equal(model, reference, context: str) -> None:
    wanted = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, (
            f"the model's {name!r} has no gradient after data_parallel_step ({context}): the "
            f"replicas' gradients must be summed back into the model (reduce_gradients_into, "
            f"after loss.backward() has computed them)"
        )
        assert_close(p.grad, wanted[name].grad, f"gradient of {name!r}, {context}, vs one device")


@pytest.mark.task1_6
@pytest.mark.parametrize("batch_size, num_replicas, loss_name", STEP_CASES)
def test_data_parallel_step_equals_one_device(ex, batch_size, num_replicas, loss_name):
    model, reference, untouched, loss, reference_loss, seen = run_step_and_reference(
        ex, batch_size, num_replicas, loss_name)
    sizes = chunk_sizes(batch_size, num_replicas)
    context = f"{batch_size} samples on {num_replicas} replicas, chunks {sizes}"
    assert sorted(seen) == sorted(sizes), (
        f"the model (or its copies) ran on batches of sizes {seen}; with {context} each "
        f"replica should run once, on its own chunk"
    )
    assert isinstance(loss, float), (
        f"data_parallel_step returned {type(loss).__name__}; return the loss as a float "
        f"(loss.item())"
    )
    assert_close(loss, reference_loss,
                 f"loss ({context}) vs one device: it must be the mean over all {batch_size} "
                 f"samples, and a plain mean of the chunks' mean losses weighs a short chunk as "
                 f"much as a full one")
    assert_gradients_equal(model, reference, context)
    assert_parameters_close(model, untouched,
                            "parameter (data_parallel_step must not update the weights)")


@pytest.mark.task1_6
def test_data_parallel_step_accumulates_like_backward(ex):
    model, reference, _, loss, reference_loss, _ = run_step_and_reference(
        ex, 10, 3, "mse", grads_before=0.5)
    assert_close(loss, reference_loss, "loss")
    assert_gradients_equal(model, reference,
                           "10 on 3 with gradients already there (backward adds to them)")


# --------------------------------------------------------------------------------------------
# The lesson's claims that hold on any machine.


def test_readme_split_table_is_tensor_chunk():
    """The splits the README lists are the ones Tensor.chunk (DataParallel's scatter) makes."""
    table = {(12, 3): [4, 4, 4], (10, 3): [4, 4, 2], (10, 4): [3, 3, 3, 1], (5, 4): [2, 2, 1],
             (6, 4): [2, 2, 2], (2, 3): [1, 1], (10, 8): [2, 2, 2, 2, 2]}
    for (batch_size, devices), sizes in table.items():
        assert chunk_sizes(batch_size, devices) == sizes, (batch_size, devices)


@pytest.mark.skipif(
    cuda_device_count() > 0,
    reason="needs a machine without a CUDA GPU (with one, DataParallel splits the batch; "
           "the gpu checks cover that)",
)
def test_data_parallel_is_a_pass_through_without_gpus():
    model = TinyNet()
    wrapped = nn.DataParallel(model)
    inputs, targets = make_batch(10)
    outputs = wrapped(inputs)
    assert wrapped.device_ids == [], f"DataParallel chose device_ids {wrapped.device_ids}"
    assert seen_batch_sizes() == [10], (
        f"without GPUs DataParallel should call the module once with the whole batch; it ran "
        f"on {seen_batch_sizes()}"
    )
    reference = copy.deepcopy(model)
    F.mse_loss(outputs, targets).backward()
    F.mse_loss(reference(inputs), targets).backward()
    assert torch.equal(outputs, reference(inputs))
    assert_parameters_close(model, reference, grads=True, rtol=0, atol=0)


def test_batchnorm_in_training_sees_only_its_chunk():
    """Why "equal to one device" needs a model whose samples do not interact: BatchNorm in
    training mode normalises each replica's chunk with that chunk's own statistics."""
    bn = nn.BatchNorm1d(4)
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(6)) * 3 + 1
    whole = bn(x)
    per_chunk = torch.cat([copy.deepcopy(bn)(c) for c in x.chunk(3)])
    assert not torch.allclose(whole, per_chunk, atol=1e-3)
    bn.eval()
    assert_close(torch.cat([bn(c) for c in x.chunk(3)]), bn(x), "BatchNorm in eval mode")


# --------------------------------------------------------------------------------------------
# The real nn.DataParallel on GPUs: one GPU listed twice, and every GPU.


@pytest.fixture
def no_tf32():
    """Full fp32 matmuls while GPU results are compared with CPU ones (TF32 would round)."""
    with full_fp32():
        yield


GPU_SETUPS = [
    pytest.param("one GPU twice", id="device_ids=[0,0]",
                 marks=gpu_marks(1, "nn.DataParallel with device_ids=[0, 0]")),
    pytest.param("every GPU", id="all GPUs",
                 marks=gpu_marks(2, "nn.DataParallel across GPUs")),
]


def device_ids_for(setup: str) -> list[int]:
    return [0, 0] if setup == "one GPU twice" else list(range(cuda_device_count()))


@pytest.mark.parametrize("setup", GPU_SETUPS)
def test_real_data_parallel_splits_and_matches_one_device(setup, no_tf32):
    device_ids = device_ids_for(setup)
    batch_size = 3 * len(device_ids) + 1  # never divisible: the last chunk is short
    sizes = chunk_sizes(batch_size, len(device_ids))
    output_device = device_ids[-1]
    model = TinyNet()
    reference = copy.deepcopy(model)  # stays on the CPU
    inputs, targets = make_batch(batch_size)

    wrapped = nn.DataParallel(model.to("cuda:0"), device_ids=device_ids,
                              output_device=output_device)
    outputs = wrapped(inputs.to("cuda:0"))
    calls = list(TinyNet.calls)
    TinyNet.calls.clear()

    # The replicas run in threads, so the record's order is not fixed: compare sorted.
    assert sorted(size for size, _ in calls) == sorted(sizes), (
        f"replicas received batches of sizes {[size for size, _ in calls]}, expected {sizes}"
    )
    used = device_ids[:len(sizes)]
    assert sorted(device.index for _, device in calls) == sorted(used), (
        f"replicas ran on {[str(d) for _, d in calls]}, expected cuda:{used}"
    )
    assert outputs.device == torch.device("cuda", output_device), (
        f"the gathered output is on {outputs.device}, expected output_device cuda:{output_device}"
    )
    loss = F.mse_loss(outputs, targets.to(outputs.device))
    loss.backward()

    reference_outputs = reference(inputs)
    reference_loss = F.mse_loss(reference_outputs, targets)
    reference_loss.backward()
    assert_close(outputs, reference_outputs, f"DataParallel{device_ids} outputs vs CPU")
    assert_close(loss, reference_loss, f"DataParallel{device_ids} loss vs CPU")
    for param in model.parameters():
        assert param.device == torch.device("cuda", 0), "the model's parameters left cuda:0"
    assert_parameters_close(model, reference, f"DataParallel{device_ids}", grads=True)


@pytest.mark.parametrize("setup", GPU_SETUPS)
def test_real_data_parallel_training_matches_one_device(setup, no_tf32):
    device_ids = device_ids_for(setup)
    batch_size = 3 * len(device_ids) + 1
    model = TinyNet().to("cuda:0")
    reference = copy.deepcopy(model)
    wrapped = nn.DataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, 4):
        inputs, targets = (t.to("cuda:0") for t in make_batch(batch_size, seed=10 + step))
        for net, opt in ((wrapped, optimizer), (reference, reference_optimizer)):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(net(inputs), targets).backward()
            opt.step()
        assert_parameters_close(model, reference,
                                f"parameter after {step} SGD steps with DataParallel{device_ids}")


class CountingNet(TinyNet):
    """Counts its forwards in an attribute: the replicas count on their own copies."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return super().forward(x)


@needs_gpus(1, "nn.DataParallel with device_ids=[0, 0]")
def test_real_data_parallel_replicates_on_every_forward():
    model = CountingNet().to("cuda:0")
    wrapped = nn.DataParallel(model, device_ids=[0, 0])
    x = torch.randn(6, 5, device="cuda:0")
    wrapped(x)
    wrapped(x)
    assert len(TinyNet.calls) == 4, f"expected 2 replicas x 2 forwards, got {TinyNet.calls}"
    assert model.forwards == 0, (
        "the wrapped module counted its own forwards; DataParallel should have run fresh "
        "replicas, whose attribute updates are lost"
    )
    model(x)
    assert model.forwards == 1


class LossInsideNet(nn.Module):
    """Returns its own mean loss, a common pattern that meets DataParallel's gather."""

    def __init__(self):
        super().__init__()
        self.net = TinyNet()

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


@needs_gpus(1, "nn.DataParallel with device_ids=[0, 0]")
def test_real_data_parallel_returns_one_loss_per_replica(no_tf32):
    model = LossInsideNet().to("cuda:0")
    wrapped = nn.DataParallel(model, device_ids=[0, 0])
    inputs, targets = (t.to("cuda:0") for t in make_batch(7))  # chunks [4, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "all input tensors were scalars; will unsqueeze"
        losses = wrapped(inputs, targets)
    assert tuple(losses.shape) == (2,), f"expected one loss per replica, got {losses.shape}"
    whole = model(inputs, targets)
    assert not torch.allclose(losses.mean(), whole), "the plain mean should be off for [4, 3]"
    weights = torch.tensor([4.0, 3.0], device=losses.device) / 7
    assert_close((losses * weights).sum(), whole, "per-replica losses weighted by chunk size")


# --------------------------------------------------------------------------------------------
# The lesson's scripts run, and print what the README says.


def script_output(name: str, *args: str) -> str:
    """What a lesson script prints (harness.launch runs it with one CPU thread and a timeout:
    these runs check what the scripts print, not their speed)."""
    return run_script(LESSONS_DIR / LESSON / name, *args, result=False).output


@pytest.mark.slow
def test_where_the_batch_goes_prints_the_split():
    gpus = cuda_device_count()
    # No GPU: 3 replicas by hand. One GPU: device_ids=[0, 0]. Several: up to 3 distinct GPUs.
    replicas = 3 if gpus == 0 else max(2, min(3, gpus))
    sizes = chunk_sizes(10, replicas)
    out = script_output("where_the_batch_goes.py", "--batch-size", "10",
                        "--replicas", str(replicas))
    assert f"a batch of 10 on {replicas} replicas: chunk sizes {sizes}" in out, out
    if gpus == 0:
        assert "nn.DataParallel is a pass-through" in out, out
        assert "in model on cpu (MainThread): input (10, 5) -> output (10, 2)" in out, out
        for i, size in enumerate(sizes):
            assert f"in model on cpu (replica {i}): input ({size}, 5) -> output ({size}, 2)" in out
    else:
        # The replicas run in threads, so their lines come in any order.
        lines = [line for line in out.splitlines() if "in model on cuda:" in line]
        seen = sorted(int(line.split("input (")[1].split(",")[0]) for line in lines)
        assert seen == sorted(sizes), out
    assert "outside: input (10, 5) -> gathered output (10, 2)" in out, out


# train.py is lesson 00's train.py plus nn.DataParallel. Both are started together, once, with
# the same arguments, none of them the default: a script that ignored one (the seed, say) would
# train a different model from lesson 00's.
TRAIN_ARGS = ("--epochs", "1", "--seed", "3", "--batch-size", "32", "--train-windows", "320")
BASE_LESSON = "00_single_gpu"


@pytest.fixture(scope="module")
def train_runs():
    runs = {lesson: start_script(LESSONS_DIR / lesson / "train.py", *TRAIN_ARGS)
            for lesson in (BASE_LESSON, LESSON)}  # start_script adds --result, .data reads it
    yield runs
    for run in runs.values():
        run.stop()


def both_results(train_runs):
    """The run of this lesson's train.py and of lesson 00's, each with its output and result."""
    return train_runs[LESSON].result(), train_runs[BASE_LESSON].result()


@pytest.mark.slow
@pytest.mark.skipif(
    cuda_device_count() > 0,
    reason="needs a machine without a CUDA GPU (with one, DataParallel splits the batch; "
           "test_train_on_gpus_stays_close_to_lesson_00 covers that)",
)
def test_train_without_gpus_is_lesson_00_bit_for_bit(train_runs):
    run, base = both_results(train_runs)
    assert "nn.DataParallel is a pass-through" in run.output, (
        f"train.py should say that without a GPU nn.DataParallel is a pass-through:\n{run.output}"
    )
    assert "epoch 1/1" in run.output, run.output
    result, expected = run.data, base.data
    assert result["device"] == "cpu" and result["device_ids"] == [], (
        f"without a GPU, DataParallel keeps no device_ids: got device {result['device']!r}, "
        f"device_ids {result['device_ids']!r}"
    )
    assert (result["seed"], result["batch_size"], result["epochs"]) == (3, 32, 1), result
    # The pass-through calls the very model lesson 00 trains, on the very same batches.
    for key in ("sample_before", "train_loss", "val_loss", "val_accuracy", "sample_after",
                "params_sha256"):
        assert result[key] == expected[key], (
            f"{key}: lesson 01 gave {result[key]!r}, lesson 00 {expected[key]!r} with the same "
            f"arguments {' '.join(TRAIN_ARGS)}; without a GPU the two runs must be identical"
        )


@pytest.mark.slow
@needs_gpus(1, "nn.DataParallel in train.py; on one GPU device_ids [0, 0]")
def test_train_on_gpus_stays_close_to_lesson_00(train_runs):
    run, base = both_results(train_runs)
    gpus = cuda_device_count()
    device_ids = list(range(gpus)) if gpus > 1 else [0, 0]
    result, expected = run.data, base.data
    assert result["device_ids"] == device_ids, (
        f"train.py ran DataParallel over {result['device_ids']}, expected {device_ids} "
        f"on a machine with {gpus} GPU(s)"
    )
    assert result["device"] == "cuda:0", result["device"]
    assert f"DataParallel over GPUs {device_ids}" in run.output, run.output
    # Same start, same batches; the replicas' chunks only change the order of float sums, so
    # the losses are close, not equal. Measured on CPU: gradients perturbed by 1e-4 (relative)
    # every step moved them by under 1e-6; another seed (model or shuffle) by 0.3% to 2%.
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(result[key]), torch.tensor(expected[key]),
                     f"{key} of DataParallel{device_ids} vs lesson 00 on one GPU",
                     rtol=1e-3, atol=0.0)


def test_train_refuses_device_ids_that_are_not_numbers(train, capsys):
    assert train.parse_args(["--device-ids", "0,1"]).device_ids == [0, 1]
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--device-ids", "0,x"])
    assert info.value.code == 2, f"exit code {info.value.code}, expected 2 (bad usage)"
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert "Traceback" not in err and "--device-ids" in last and "0,x" in last, (
        f"expected one usage error naming --device-ids and the bad value, got:\n{err}"
    )
    assert "0,1" in last, f"the error should show what is expected, like 0,1: {last}"


@pytest.mark.parametrize("argv, expected", [
    (["--device", "cpu"], "lessons/00_single_gpu/train.py --device cpu"),
    (["--device-ids", "0,5"], "this machine has GPUs 0 to 1"),
    (["--bf16"], "autocast to float16"),  # the replica threads do not inherit the dtype
    (["--compile"], "new replicas of the model every step"),
])
def test_train_refuses_what_data_parallel_cannot_do_on_a_gpu_machine(train, monkeypatch, capsys,
                                                                     argv, expected):
    """On a machine with GPUs, DataParallel takes them all: no CPU run, no GPU that is not
    there; nor bfloat16 autocast, nor --compile. Each is refused in one line before anything
    touches CUDA (imitated: 2 GPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code = train.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, f"train.main({argv}) returned {code}, expected 2 (bad usage)"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, f"one line expected:\n{err}"
    assert expected in err, f"the message should say {expected!r}: {err}"


class StopBeforeTraining(Exception):
    pass


@pytest.mark.skipif(
    cuda_device_count() > 0,
    reason="needs a machine without a CUDA GPU (with one, DataParallel takes every GPU)",
)
def test_fit_on_cpu_wraps_the_model_in_a_pass_through_data_parallel(train, monkeypatch):
    trained = []

    def first_epoch(model, *args, **kwargs):  # record what fit trains, then stop
        trained.append(model)
        raise StopBeforeTraining

    monkeypatch.setattr(train, "train_one_epoch", first_epoch)
    log = []
    with pytest.raises(StopBeforeTraining):
        train.fit(torch.device("cpu"), epochs=1, log=log.append)
    step_model = trained[0]
    assert isinstance(step_model, nn.DataParallel), (
        f"fit trained a {type(step_model).__name__}; it should train the model wrapped in "
        f"nn.DataParallel"
    )
    assert isinstance(step_model.module, train.GPT), type(step_model.module)
    assert step_model.device_ids == [], (
        f"on a machine without CUDA, DataParallel keeps no device_ids; got "
        f"{step_model.device_ids}"
    )
    assert any("pass-through" in line for line in log), log
    inputs = torch.randint(0, step_model.module.config.vocab_size, (3, 8),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(step_model(inputs)[0], step_model.module(inputs)[0]), (
            "the pass-through should call the model itself on the whole batch"
        )


@pytest.mark.slow
def test_walkthrough_runs_as_a_script():
    out = script_output("walkthrough.py")
    assert "10 samples on 3 GPUs -> [4, 4, 2]" in out, out
    assert "the model's own gradients after backward: [None, None, None, None]" in out, out
