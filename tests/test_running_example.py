"""The running example (lessons/gpt) is sound: every lesson builds on these properties."""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections import Counter

import pytest
import torch
from gpt import (
    GPT,
    MLP,
    SIZES,
    CausalSelfAttention,
    CharDataset,
    GPTConfig,
    GPTStage,
    train_val_split,
)
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

BATCH, STEPS, LR = 16, 60, 3e-3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to gain from a second thread, and on a busy 2-core
    machine every multi-threaded op waits a scheduler slice for it: measured 300 ms instead of
    3 ms per forward while other tests ran."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset():
    return CharDataset(block_size=32)


@pytest.fixture(scope="module")
def tiny(dataset):
    return GPTConfig.named("tiny", vocab_size=dataset.vocab_size)


def fixed_batches(dataset, n=4):
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return [batch for batch, _ in zip(loader, range(n), strict=False)]


def mean_loss(model, batches):
    with torch.no_grad():
        return sum(model(x, y)[1].item() for x, y in batches) / len(batches)


def sample(model, dataset, seed=0, n=400):
    start = torch.tensor([dataset.encode("\n")])
    out = model.generate(start, n, generator=torch.Generator().manual_seed(seed))
    return dataset.decode(out[0, 1:])


def common_fraction(text, reference, top=10):
    """The share of ``text``'s characters among ``reference``'s ``top`` most common ones."""
    common = {c for c, _ in Counter(reference).most_common(top)}
    return sum(c in common for c in text) / len(text)


@pytest.fixture(scope="module")
def trained(dataset, tiny):
    """The tiny model before and after STEPS AdamW steps cycling over 4 fixed batches."""
    model = GPT(tiny, seed=0)
    batches = fixed_batches(dataset)
    before = {"loss": mean_loss(model, batches), "sample": sample(model, dataset)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    curve = []
    for step in range(STEPS):
        x, y = batches[step % len(batches)]
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(loss.item())
    after = {"loss": mean_loss(model, batches), "sample": sample(model, dataset)}
    print(f"\nloss on the fixed batches {before['loss']:.3f} -> {after['loss']:.3f}; "
          f"training curve {[round(v, 2) for v in curve[::10]]}")
    print(f"sample before: {before['sample'][:120]!r}\nsample after:  {after['sample'][:120]!r}")
    return model, before, after


# (a)
def test_forward_shapes_and_initial_loss(dataset, tiny):
    model = GPT(tiny, seed=0)
    x, y = next(iter(DataLoader(dataset, batch_size=BATCH)))
    logits, loss = model(x, y)
    assert logits.shape == (BATCH, tiny.block_size, dataset.vocab_size)
    assert model(x)[1] is None
    # At init every character is about equally likely: loss = ln(vocab).
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.log(dataset.vocab_size), rel=0.1)


# (b)
@pytest.mark.parametrize("t", [0, 9, 30])
def test_attention_is_causal(dataset, tiny, t):
    model = GPT(tiny, seed=0)
    g = torch.Generator().manual_seed(t)
    idx = torch.randint(dataset.vocab_size, (2, tiny.block_size), generator=g)
    changed = idx.clone()
    changed[:, t + 1:] = (idx[:, t + 1:] + 1) % dataset.vocab_size  # every later token differs
    logits, _ = model(idx)
    logits_changed, _ = model(changed)
    torch.testing.assert_close(logits_changed[:, :t + 1], logits[:, :t + 1],
                               msg=lambda m: f"positions <= {t} saw later tokens: {m}")
    assert not torch.allclose(logits_changed[:, t + 1:], logits[:, t + 1:])


# (c)
def test_init_is_seeded_and_leaves_the_global_rng_alone(tiny):
    rng_before = torch.get_rng_state()
    a, b, c = GPT(tiny, seed=0), GPT(tiny, seed=0), GPT(tiny, seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before), "construction moved the global RNG"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)  # a different global state must not change the model
        d = GPT(tiny, seed=0)
    for (name, pa), pb, pc, pd in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                      d.parameters(), strict=True):
        assert torch.equal(pa, pb), f"{name} differs between two models with seed 0"
        assert torch.equal(pa, pd), f"{name} depends on the global RNG"
        if pa.std() > 0:  # LayerNorm weights and biases are constants, the same for every seed
            assert not torch.equal(pa, pc), f"{name} is the same for seeds 0 and 1"
    # GPT-2 init: std 0.02, residual projections scaled down by 1/sqrt(2 * n_layer).
    assert a.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    residual = a.blocks[0].mlp.down_proj.weight.std().item()
    assert residual == pytest.approx(0.02 / math.sqrt(2 * tiny.n_layer), rel=0.1)


# (d)
def test_loss_falls(trained):
    _, before, after = trained
    # Measured: 4.12 -> 2.39, a 42 % drop (44 % with model seeds 1 and 2); ln(61) = 4.11.
    assert after["loss"] < 0.7 * before["loss"], (before["loss"], after["loss"])


# (e)
def test_samples_look_more_like_the_text(trained, dataset):
    _, before, after = trained
    share_before = common_fraction(before["sample"], dataset.text)
    share_after = common_fraction(after["sample"], dataset.text)
    # The 10 commonest characters are about 2/3 of the text and 10/61 of the vocabulary.
    # Measured: 0.16 at init, 0.61 after training (0.68 and 0.73 with model seeds 1, 2).
    assert share_before < 0.3 < 0.4 < share_after, (share_before, share_after)
    model = trained[0]
    greedy = model.generate(torch.tensor([dataset.encode("\n")]), 50, temperature=0)
    assert common_fraction(dataset.decode(greedy[0, 1:]), dataset.text) > 0.4  # measured 0.98


def test_sampling_is_reproducible(dataset, tiny):
    model = GPT(tiny, seed=0)
    rng_before = torch.get_rng_state()
    assert sample(model, dataset, seed=3, n=20) == sample(model, dataset, seed=3, n=20)
    assert sample(model, dataset, seed=3, n=20) != sample(model, dataset, seed=4, n=20)
    assert torch.equal(torch.get_rng_state(), rng_before), "sampling drew from the global RNG"


# (f)
def test_char_dataset(dataset):
    text, block = dataset.text, dataset.block_size
    assert dataset.decode(dataset.encode(text[:500])) == text[:500]
    assert dataset.vocab_size == len(set(text))
    # Every window is whole, and one more would run past the end of the text.
    assert (len(dataset) - 1) * block + block + 1 <= len(text) < len(dataset) * block + block + 1
    for i in (0, 1, len(dataset) - 1):
        x, y = dataset[i]
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (block,)
        assert torch.equal(x[1:], y[:-1]), "y must be x shifted by one"
        assert dataset.decode(x) + dataset.decode(y[-1:]) == text[i * block:(i + 1) * block + 1]
        again = dataset[i]
        assert torch.equal(again[0], x) and torch.equal(again[1], y), "sample i must not change"
    assert torch.equal(dataset[-1][1], dataset[len(dataset) - 1][1])
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    train, val = train_val_split(dataset, 0.1)
    assert len(train) + len(val) == len(dataset) and len(val) == round(0.1 * len(dataset))


def test_distributed_sampler_gives_disjoint_shards():
    dataset = CharDataset(block_size=4, text="the quick brown fox jumps over the lazy dog!")
    assert len(dataset) == 10  # even: two replicas get 5 each, no padding
    shards = [list(DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=0))
              for r in range(2)]
    assert [len(s) for s in shards] == [5, 5]
    assert sorted(shards[0] + shards[1]) == list(range(10)), shards
    x, y = next(iter(DataLoader(dataset, batch_size=5, sampler=DistributedSampler(
        dataset, num_replicas=2, rank=1, shuffle=False))))
    assert x.shape == y.shape == (5, 4)


# (g)
@pytest.mark.parametrize("size", sorted(SIZES))
def test_heads_split_cleanly(size):
    config = GPTConfig.named(size, vocab_size=61)
    assert config.n_head % 4 == 0 and config.n_layer % 4 == 0, "split 2 or 4 ways"
    with torch.device("meta"):  # shapes only: the gpu size needs no memory here
        attn, mlp = CausalSelfAttention(config), MLP(config)
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, mlp.up_proj, mlp.down_proj):
        assert proj.in_features % config.n_head == 0 and proj.out_features % config.n_head == 0
    assert attn.head_dim * config.n_head == config.n_embd


def test_attention_is_the_sum_over_head_groups(tiny):
    """What tensor parallelism relies on: give each of two shards half the heads (q/k/v split by
    output features, out_proj by input features); the shards run the same forward, unchanged,
    and their partial outputs add up to the whole (out_proj's bias added once)."""
    attn = GPT(tiny, seed=0).blocks[0].attn
    x = torch.randn(2, 8, tiny.n_embd, generator=torch.Generator().manual_seed(0))
    half = tiny.n_embd // 2  # the features of the first n_head / 2 heads
    partial = []
    for cols in (slice(0, half), slice(half, None)):
        shard = copy.deepcopy(attn)
        for name in ("q_proj", "k_proj", "v_proj"):
            full, part = getattr(attn, name), getattr(shard, name)
            part.weight = nn.Parameter(full.weight.detach()[cols])
            part.bias = nn.Parameter(full.bias.detach()[cols])
        shard.out_proj.weight = nn.Parameter(attn.out_proj.weight.detach()[:, cols])
        shard.out_proj.bias = None
        with torch.no_grad():
            partial.append(shard(x))
    with torch.no_grad():
        torch.testing.assert_close(partial[0] + partial[1] + attn.out_proj.bias, attn(x))


# (h)
def test_tiny_stays_tiny(dataset, tiny):
    model = GPT(tiny, seed=0)
    x, y = next(iter(DataLoader(dataset, batch_size=BATCH)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    times = []  # one_thread has set torch.set_num_threads(1)
    for _ in range(6):
        start = time.perf_counter()
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    print(f"\ntiny: {model.num_parameters()} parameters, one training step (batch {BATCH}, "
          f"context {tiny.block_size}, 1 thread) {min(times[1:]) * 1e3:.1f} ms")
    assert model.num_parameters() < 300_000


@pytest.mark.parametrize("cut", [(4,), (1, 3), (2, 2), (1, 1, 1, 1)], ids=str)
def test_stages_chained_are_the_model_and_share_its_modules(tiny, cut):
    """GPTStage (lesson 07): consecutive runs of blocks, the embeddings on the first and the
    head on the last, computing the model's logits and gradients with the model's own modules."""
    whole = GPT(tiny, seed=0)
    model = copy.deepcopy(whole)
    bounds = [sum(cut[:i]) for i in range(len(cut) + 1)]
    stages = [GPTStage(model, a, b) for a, b in itertools.pairwise(bounds)]
    owned = [id(p) for stage in stages for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters()), "each parameter once"
    tokens = torch.randint(0, tiny.vocab_size, (2, tiny.block_size),
                           generator=torch.Generator().manual_seed(0))
    x = tokens
    for stage in stages:
        x = stage(x)
    logits, _ = whole(tokens)
    torch.testing.assert_close(x, logits)
    x.sum().backward()
    logits.sum().backward()
    for (name, p), q in zip(model.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("start,end", [(2, 2), (3, 1), (0, 5), (-1, 2)])
def test_a_stage_must_be_a_run_of_the_models_blocks(tiny, start, end):
    with pytest.raises(ValueError, match="not a stage of a model of 4 blocks"):
        GPTStage(GPT(tiny), start, end)


def test_the_parameter_counts_lesson_07_quotes(tiny):
    """07 README, balancing the stages: "the embeddings hold 2,976 parameters, a quarter of one
    block's 12,704"."""
    model = GPT(tiny)
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    assert count(model.tok_emb, model.pos_emb) == 2976
    assert count(model.blocks[0]) == 12704


def meshes_on_rank(ctx, shape, names) -> dict:
    """run.device_mesh next to init_device_mesh: the ranks of each group and the timeouts."""
    import torch.distributed as dist
    from gpt import run
    from torch.distributed.device_mesh import init_device_mesh

    def seen(mesh):
        return {"mesh": mesh.mesh.tolist(),
                "groups": [dist.get_process_group_ranks(mesh.get_group(n)) for n in names],
                "local": [mesh.get_local_rank(n) for n in names],
                "coordinate": mesh.get_coordinate(),
                "timeouts": [mesh.get_group(n)._get_backend(torch.device("cpu")).options._timeout
                             for n in names]}

    ours, torchs = seen(run.device_mesh("cpu", shape, names)), seen(
        init_device_mesh("cpu", shape, mesh_dim_names=names))
    assert ours["timeouts"] == [run.TIMEOUT] * len(names), ours  # 60 s, in the test below
    mesh = run.device_mesh("cpu", shape, names)  # slicing works as torch's does
    try:
        run.device_mesh("cpu", (3,), ("x",))
        refused = None
    except ValueError as error:
        refused = str(error)
    return {"ours": {**ours, "timeouts": None}, "torch": {**torchs, "timeouts": None},
            "sliced": [dist.get_process_group_ranks(mesh[n].get_group()) for n in names],
            "refused": refused}


@pytest.mark.parametrize("shape,names", [((4,), ("dp",)), ((2, 2), ("dp", "tp")),
                                         ((1, 4), ("dp", "cp")), ((4, 1), ("dp", "ep")),
                                         ((1, 2, 2), ("pp", "dp", "tp"))], ids=str)
def test_device_mesh_is_init_device_mesh_with_the_course_timeout(shape, names):
    """gpt.run.device_mesh places every rank and builds every group as init_device_mesh does,
    and each of its groups waits at most run.TIMEOUT (60 s here; init_device_mesh's subgroups
    wait 30 minutes on gloo), and refuses a shape that does not hold every rank."""
    from harness.ranks import run_on_ranks

    for rank, found in enumerate(run_on_ranks(meshes_on_rank, shape, names,
                                              world_size=4, pg_timeout=60)):
        assert found["ours"] == found["torch"], (rank, found)
        assert found["sliced"] == found["torch"]["groups"], (rank, found)
        assert found["refused"] == "a mesh of shape (3,) has 3 places for 4 processes", found
