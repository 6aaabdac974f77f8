"""Lesson 05 exercises: sharded data parallel. ZeRO stages 1 to 3 by hand, then FSDP2.

Grade with ``pytest lessons/05_sharded_data_parallel`` (one task: ``-m task5_1``). Each
function's docstring is its contract: what it takes, what it returns, and what the test checks.

Every sharded piece here uses the same layout, the one ``shard_bounds`` describes: a parameter is
flattened, thought of as zero-padded to ``world_size * shard_size`` elements, and cut into
``world_size`` equal pieces; rank r owns piece r. Collectives always move whole padded pieces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now warn);
# torch 2.11 and 2.12 have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def shard_size(numel: int, world_size: int) -> int:
    """Elements in each rank's piece of a tensor of ``numel`` elements: ceil(numel / world)."""
    return -(-numel // world_size)


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)``: the real elements of ``rank``'s piece of a flattened tensor.

    Every piece has room for ``shard_size(numel, world_size)`` elements; the zero padding that
    makes ``numel`` divisible falls in the last pieces, which hold fewer real elements, or none
    (``start == end``) when there are more ranks than elements to share.
    """
    size = shard_size(numel, world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


# --8<-- [start:memory_per_rank]
def memory_per_rank(num_params: int, world_size: int, stage: int, param_bytes: int = 4,
                    grad_bytes: int = 4, optimizer_bytes: int = 8) -> dict[str, int]:
    """Bytes of training state on one rank: stage 0 is DDP, stages 1-3 are ZeRO's.

    ``num_params`` parameters (the paper's Ψ), each stored in ``param_bytes`` bytes, its gradient
    in ``grad_bytes``, and ``optimizer_bytes`` bytes of optimizer state per parameter (the
    paper's K: 8 for AdamW's two fp32 moments; 12 under mixed precision, which adds an fp32
    master copy of each bf16 parameter). Stage 0 keeps everything whole on every rank; stage 1
    shards the optimizer state across the ``world_size`` ranks, stage 2 the gradients as well,
    stage 3 the parameters as well. A sharded quantity takes ``ceil(num_params / world_size)``
    elements on the rank that holds the most (the padding described in ``shard_bounds``).

    Returns ``{"parameters": ..., "gradients": ..., "optimizer_state": ..., "total": ...}``,
    whole numbers of bytes. A ``stage`` other than 0-3, ``world_size < 1`` or ``num_params < 0``
    raises ``ValueError``.

    The test checks a table of cases (fp32 and mixed precision, divisible and not, the ZeRO
    paper's figure) and bad input; the lesson's other checks measure the same formula on real
    ranks.
    """
    raise NotImplementedError("task5_1: bytes of parameters, gradients, optimizer state per rank")
# --8<-- [end:memory_per_rank]


# --8<-- [start:reduce_scatter_mean]
def reduce_scatter_mean(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the mean of ``tensor`` over all ranks: the first collective of ZeRO.

    ``tensor`` (any shape; the same shape on every rank, different values) is flattened and
    zero-padded to ``world_size * shard_size(numel, world_size)`` elements;
    ``reduce_scatter_single`` gives this rank the sum over all ranks of its piece, and dividing
    by the world size makes it the mean, as DDP takes it. Returns a 1-D tensor of ``shard_size``
    elements: the whole piece, padding included (``shard_bounds`` tells which are real).

    The test checks it on 2, 3 and 4 ranks with shapes that do not divide, against the mean of
    every rank's tensor, and counts one reduce-scatter of the padded size.
    """
    raise NotImplementedError("task5_2: pad, reduce-scatter, divide by the world size")
# --8<-- [end:reduce_scatter_mean]


# --8<-- [start:all_gather_pieces]
def all_gather_pieces(piece: torch.Tensor, numel: int) -> torch.Tensor:
    """The whole flat tensor of ``numel`` elements, from every rank's piece: ZeRO's second.

    ``piece`` is this rank's 1-D piece: its real elements (``shard_bounds``), or the whole
    padded piece of ``shard_size(numel, world_size)`` elements. Zero-pad it to that size,
    ``all_gather_single`` every rank's piece, in rank order, into one tensor of
    ``world_size * shard_size`` elements, and return its first ``numel``.

    The test checks it on 2, 3 and 4 ranks, pieces short or padded, and counts one all-gather.
    """
    raise NotImplementedError("task5_2: pad the piece, all-gather, keep numel elements")
# --8<-- [end:all_gather_pieces]


# --8<-- [start:Zero1Optimizer]
class Zero1Optimizer:
    """ZeRO stage 1: each rank keeps the optimizer state of its shard only.

    ``Zero1Optimizer(params, optimizer_class=torch.optim.AdamW, **defaults)``: for each
    parameter, this rank's piece (``shard_bounds``) as a view of the parameter's own memory,
    ``param.detach().view(-1)[start:end]`` (a leaf tensor: stepping it updates the parameter in
    place), and ``self.optimizer = optimizer_class(those views, **defaults)``. The inner
    optimizer then keeps state (AdamW: ``exp_avg`` and ``exp_avg_sq``) for 1/W of the elements.
    Parameters and their gradients stay whole, as in DDP.

    ``step()``, after every rank's ``loss.backward()``:

    1. for each parameter, ``reduce_scatter_mean`` its gradient and give the real elements of
       this rank's piece to the view as its ``.grad``; the whole gradient is not needed again:
       ``param.grad = None``;
    2. ``self.optimizer.step()``: only this rank's piece of each parameter moves. Then set the
       views' ``.grad`` to ``None``: they are not needed again;
    3. for each parameter, ``all_gather_pieces`` the updated views and copy the whole into the
       parameter: every rank holds the whole updated model again.

    A parameter without a gradient raises ``RuntimeError`` naming it (its index and shape),
    before any collective: ``step()`` was called before ``backward()``.
    ``zero_grad(set_to_none=True)`` clears the parameters' gradients (a training loop calls it
    before each backward, as with any optimizer).

    The test trains with it beside DDP on 2, 3 and 4 ranks (AdamW, and SGD, which shows a
    gradient's scale) and compares the parameters after every step, also with 2 and 3
    accumulated backwards per step (against DDP under ``no_sync``); it measures that each
    rank's optimizer holds 1/W of the state (to the padding), and counts the bytes
    reduce-scattered and all-gathered: one model's worth each, what DDP's all-reduce moves.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, **defaults):
        raise NotImplementedError("task5_2: views of this rank's pieces, an optimizer on them")

    def step(self) -> None:
        raise NotImplementedError("task5_2: reduce-scatter, step the pieces, all-gather them back")

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError("task5_2: clear the parameters' gradients")
# --8<-- [end:Zero1Optimizer]


# --8<-- [start:Zero2Optimizer]
class Zero2Optimizer:
    """ZeRO stage 2: each rank keeps the optimizer state *and the gradients* of its shard only.

    ``Zero2Optimizer(params, optimizer_class=torch.optim.AdamW, **defaults)`` keeps this rank's
    piece of each parameter as a view and an inner ``self.optimizer`` over the views, exactly as
    ``Zero1Optimizer`` does. It also registers a hook on each parameter
    (``param.register_post_accumulate_grad_hook``), which backward calls as soon as that
    parameter's gradient is complete. The hook:

    1. ``reduce_scatter_mean`` the gradient and add the real elements of this rank's piece to
       the view's ``.grad`` (or make them its ``.grad`` when it has none): with gradient
       accumulation, several backwards run before one ``step()``, and each must count;
    2. frees the whole gradient at once: ``param.grad = None``.

    So the parameters' ``.grad`` never hold more than one whole gradient (the one being
    reduced) beside the gradient pieces: gradient memory falls from Ψ to Ψ/W. (Autograd may
    still hold a gradient it has computed but not yet accumulated into ``.grad``.)

    ``step()``: every parameter must have been reduced since the last step, else
    ``RuntimeError`` naming the first that was not (its index and shape: ``step()`` before
    ``backward()``), raised before any collective. Then, as in ZeRO-1: step the inner optimizer,
    set the views' ``.grad`` to ``None``, and all-gather the pieces back into the whole
    parameters. ``zero_grad()`` clears every gradient this optimizer keeps, the pieces' ``.grad``
    as well as the parameters', as any optimizer's does: a backward before it no longer counts.
    ``remove()`` removes the hooks.

    The test trains with it beside DDP on 2, 3 and 4 ranks, compares the parameters after every
    step (and the first step's updates, with SGD too), with 2 and 3 accumulated backwards per
    step (against DDP under ``no_sync``), and after a backward thrown away by ``zero_grad()``;
    it measures the whole gradients a rank holds at every point of backward, and counts the
    bytes reduce-scattered and all-gathered.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, **defaults):
        raise NotImplementedError("task5_3: pieces and optimizer as in ZeRO-1, plus a grad hook")

    def _reduce_scatter_gradient(self, param: nn.Parameter) -> None:
        raise NotImplementedError("task5_3: reduce-scatter into the piece, free the whole grad")

    def step(self) -> None:
        raise NotImplementedError("task5_3: check, step the pieces, all-gather them back")

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError("task5_3: clear every gradient, the pieces' too")

    def remove(self) -> None:
        raise NotImplementedError("task5_3: remove the hooks")
# --8<-- [end:Zero2Optimizer]


# --8<-- [start:shard_model]
def shard_model(model: nn.Module, reshard_after_forward: bool = True, mp_policy=None):
    """FSDP2 on the running example: ``fully_shard`` every block, then the root; return it.

    ``model`` is a ``gpt.GPT`` (its blocks in ``model.blocks``), the same on every rank.

    1. Check that it is the same on every rank: the names and shapes of its parameters,
       compared with ``dist.all_gather_object``. A rank holding another model would post other
       collectives and hang; raise ``ValueError`` naming the first rank that differs from rank 0
       and the first parameter where it differs (where one rank's parameters are the other's
       with more after them: both ranks' numbers of parameters).
    2. A mesh over all ranks: ``init_device_mesh(<the parameters' device type>, (world_size,))``.
    3. ``fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
       mp_policy=policy)`` for each block, first, with ``policy`` the ``mp_policy`` given, or
       ``MixedPrecisionPolicy()`` (no mixed precision) when it is ``None``. Each block becomes
       one group of parameters, all-gathered just before its forward, and, with
       ``reshard_after_forward=True``, freed after it and gathered again before its backward;
       its gradients are reduce-scattered as soon as its backward is done.
    4. ``fully_shard(model, mesh=mesh, mp_policy=policy)`` last: the root's group holds what is
       left (embeddings, final norm, head). Leave its ``reshard_after_forward`` to FSDP, which
       keeps the root unsharded after forward (backward starts with it).

    Build the optimizer afterwards, on ``model.parameters()``: they are now DTensors holding
    this rank's shard.

    The test trains it beside DDP on 2, 3 and 4 ranks; counts the all-gathers of a step (the
    root once, each block once or twice) and their bytes; measures the unsharded parameters a
    rank holds at the end of the forward with ``reshard_after_forward`` True and False; trains
    2 and 3 accumulated backwards per step (``set_requires_gradient_sync(False)`` on all but the
    last) against DDP under ``no_sync``; and gives one rank a model with another block, then one
    wider, then one with a layer more after the head.
    """
    raise NotImplementedError("task5_4: same model everywhere? fully_shard each block, then root")
# --8<-- [end:shard_model]


# --8<-- [start:AllGatherShard]
class AllGatherShard(torch.autograd.Function):
    """One parameter, whole, from every rank's piece; its gradient goes back as pieces.

    ``AllGatherShard.apply(shard, shape)``: ``shard`` is this rank's padded piece (a 1-D tensor
    of ``shard_size(numel, world_size)`` elements, ``numel`` the product of ``shape``).

    - forward: ``all_gather_pieces`` the whole parameter, viewed as ``shape``;
    - backward: ``reduce_scatter_mean`` the whole parameter's gradient: this rank's piece of the
      mean over all ranks is the gradient of ``shard`` (``None`` for ``shape``).

    The test checks forward and backward on 2, 3 and 4 ranks, with shapes that do not divide.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, shape) -> torch.Tensor:
        raise NotImplementedError("task5_5: all-gather the pieces into the whole parameter")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("task5_5: reduce-scatter the gradient into this rank's piece")
# --8<-- [end:AllGatherShard]


# --8<-- [start:Zero3Blocks]
class Zero3Blocks(nn.Module):
    """ZeRO stage 3 by hand for a stack of blocks: parameters sharded too.

    ``Zero3Blocks(blocks)`` takes an ``nn.ModuleList`` of blocks, the same on every rank, and
    keeps for each of their parameters, in the order of ``blocks.named_parameters()``, only
    this rank's padded piece of its flattened values (``shard_bounds``, zero-padded to
    ``shard_size`` elements) as an ``nn.Parameter`` in ``self.shards`` (an
    ``nn.ParameterList``). The blocks keep their structure but give up their memory:
    ``self.blocks = blocks.to("meta")``. An optimizer built on ``.parameters()`` then steps
    the pieces only: its state is sharded with them.

    ``forward(x)`` runs the blocks in order. For each block: gather each of its parameters
    whole with ``AllGatherShard.apply(piece, shape)``, run the block on them with
    ``torch.func.functional_call(block, {name: whole, ...}, (x,))``, and let them go. To free
    the whole parameters after the block's forward and gather them again for its backward, run
    that gather-and-forward under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    autograd then keeps only the block's input, and backward re-runs the function, all-gathering
    again, before it computes the block's gradients (the re-run recomputes the block's
    activations too: that is activation checkpointing, a memory saving of its own).

    The test trains it beside DDP on 2, 3 and 4 ranks: gradient pieces after the first
    backward, parameters after several AdamW steps; it checks that no all-gathered parameter
    is still held once the forward is over, counts the all-gathers (two per parameter per
    step) and reduce-scatters (one), and measures the bytes each rank holds.
    """

    def __init__(self, blocks: nn.ModuleList):
        raise NotImplementedError("task5_5: keep this rank's padded pieces; blocks to meta")

    def _gather_and_run(self, index: int, x: torch.Tensor, *pieces: torch.Tensor):
        raise NotImplementedError("task5_5: gather the block's parameters, run it on them")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("task5_5: each block's gather-and-run under checkpoint")
# --8<-- [end:Zero3Blocks]


# --8<-- [start:checkpoint_blocks]
def checkpoint_blocks(model: nn.Module, every: int = 1) -> nn.Module:
    """Activation checkpointing for every ``every``-th block of ``model.blocks``: blocks
    ``every - 1``, ``2 every - 1``, ... (all of them for 1), as torchtitan's
    ``selective_ac_option`` counts them.

    Replace each of those blocks, in place, by the block wrapped so that its forward keeps only
    its input for the backward, and the backward runs the block's forward again to get the
    rest. Return ``model``. torch's ``checkpoint_wrapper`` (from
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, what torchtitan applies
    before ``fully_shard``) does it; so does ``torch.utils.checkpoint.checkpoint`` in a module
    of your own, if it keeps the contract:

    - the non-reentrant variant (``use_reentrant=False``): the reentrant one gives a block's
      parameters no gradient when the block's input needs none (frozen embeddings), and
      refuses ``torch.autograd.grad``;
    - the recomputation draws the forward's dropout masks (``preserve_rng_state=True``, the
      default), and the global generator ends where it would have without checkpointing;
    - ``model.state_dict()`` keeps its keys, so that a state saved without checkpointing loads
      with it (``checkpoint_wrapper`` takes its ``_checkpoint_wrapped_module.`` out of them);
    - ``every < 1`` raises ValueError; an ``every`` past the last block wraps none.

    The test compares the loss, every gradient and the generator's state after a step with
    dropout against the model unwrapped, for 1 to 4 blocks and ``every`` from 1 to 5; counts each
    block's forwards (two for a checkpointed block, one for the others) and the bytes autograd
    keeps (the unwrapped model's, less what each checkpointed block keeps inside, plus its
    input); freezes the embeddings; asks ``torch.autograd.grad``; loads an unwrapped model's
    state dict; and shards the wrapped model with ``fully_shard`` on 2 ranks.
    """
    raise NotImplementedError("task5_6: wrap every every-th block with checkpoint_wrapper")
# --8<-- [end:checkpoint_blocks]


# --8<-- [start:prefetch]
def prefetch(blocks: list[nn.Module], forward: int = 1, backward: int = 1) -> None:
    """Have FSDP2 start all-gathers ahead of need. ``blocks``: modules, each already passed to
    ``fully_shard``, in the order the forward runs them (``list(model.blocks)``).

    - When block ``i``'s forward begins, it starts the all-gathers of the next ``forward``
      blocks, ``i + 1`` to ``i + forward`` (near the end, as many as are left).
    - When block ``i``'s backward begins, it starts those of the ``backward`` blocks before it,
      nearest first: ``i - 1``, ``i - 2``, ... to ``i - backward`` (as many as there are).
    - ``forward=0`` starts none ahead: each block's all-gather starts at its own forward, FSDP's
      default. ``backward=0`` leaves the backward to FSDP's default: one block ahead.
    - ``forward < 0`` or ``backward < 0`` raises ValueError.

    Every ``fully_shard``-ed module has ``set_modules_to_forward_prefetch(modules)`` and
    ``set_modules_to_backward_prefetch(modules)``: the list of modules whose all-gathers it
    starts, in that list's order, after its own.

    The test runs a step of a tower of 1 to 5 blocks, each of a different size, on 2 ranks, for
    ``forward`` and ``backward`` from 0 to 6. It checks which all-gathers have started when each
    block's forward and backward begin, their order, that each block is gathered once per
    pass, and that the gradients are those of the same step without prefetching.
    """
    raise NotImplementedError("task5_7: set each block's forward and backward prefetch lists")
# --8<-- [end:prefetch]


# --8<-- [start:build_sharded]
def build_sharded(config, seed: int = 0, device: str = "cpu") -> nn.Module:
    """The running example built sharded from the start, for a model too large for one rank:
    each rank allocates only its shards, and the result is ``GPT(config, seed)``, sharded as
    lesson 05 shards it (``fully_shard`` on each block, then on the model).

    Build the GPT on the meta device (``with torch.device("meta"):``): parameters with shapes
    and no memory. Shard it there, then ``model.to_empty(device=device)``: each rank allocates
    its shards, holding whatever was in that memory. Then give them the values an eager build
    gives them: ``model.init_weights(generator)`` draws each weight whole from a seeded CPU
    generator, in the eager build's order, and copies it into the parameter; into a sharded
    parameter (a DTensor) it copies this rank's rows of the draw into the local shard.

    Return the model. The test builds GPTs of generated sizes on 2 and 3 ranks, and one whose
    vocabulary (2 rows) is smaller than its 3 ranks, and compares every parameter, gathered,
    and each rank's rows, with ``GPT(config, seed)``'s; checks that
    every block and the model are ``fully_shard``-ed; and measures the most bytes a rank holds
    at once while building (``harness.memory.AllocationPeak``): its shards plus at most three
    times the largest parameter (a weight's draw, its scaled copy, and slack), never the whole
    model.
    """
    raise NotImplementedError("task5_8: meta device, fully_shard, to_empty, init_weights")
# --8<-- [end:build_sharded]


# --8<-- [start:activation_bytes]
def activation_bytes(config, batch_size: int, checkpoint: bool = False) -> int:
    """The bytes autograd keeps from one training forward of the running example
    (``GPT(config)``, fp32, dropout 0, attention by the CPU's kernel) on ``batch_size`` sequences
    of ``config.block_size`` tokens, with the targets: what a rank holds between its forward and
    its backward, the parameters aside.

    Count each storage once (the three projections share one input; a view saves no new bytes).
    Per token, writing C = ``n_embd`` and H = ``n_head``, a block keeps 16C + H + 4 floats (the
    README's table under "What a forward keeps" names each); a block checkpointed
    (``checkpoint=True`` checkpoints every block, as ``checkpoint_blocks(model, every=1)`` does)
    keeps only its input, C floats. Outside the blocks the forward keeps the token ids and the
    targets (int64, 8 bytes each), the positions (int64, one per position: the batch shares
    them), the final norm's input, mean, reciprocal standard deviation and output (2C + 2 floats
    per token), the log-softmax of the logits (V = ``vocab_size`` floats per token) and one
    float (the loss's total weight).

    A ``batch_size`` below 1, or a ``config`` with dropout, raises ``ValueError`` (dropout keeps
    masks this count leaves out).

    The test asks torch itself: its saved-tensors hooks, handed everything autograd keeps, on
    generated sizes (with and without biases and checkpointing); it must be exact.
    """
    raise NotImplementedError("task5_9: what each block keeps, and what the rest keeps")
# --8<-- [end:activation_bytes]


# --8<-- [start:peak_bytes]
def peak_bytes(config, batch_size: int, world_size: int = 1, stage: int = 0,
               checkpoint: bool = False, offload: bool = False) -> int:
    """The most bytes one rank holds during a training step of the running example with AdamW,
    predicted: ``batch_size`` sequences in all, split evenly over ``world_size`` ranks. Stage 0
    is DDP with ``gradient_as_bucket_view=True`` (the gradients are views into its buckets:
    one copy); stage 3 is FSDP2 (``fully_shard`` on each block, then on the model) with
    ``zero_grad(set_to_none=False)``. Either way the rank holds its training state throughout
    the step, so the peak is

        state + activations + the largest transient (+ FSDP2's gathered parameters)

    - state: ``memory_per_rank(Ψ, world_size, stage)["total"]`` (your task5_1), Ψ the model's
      parameters: 2VC + TC (embeddings and head), 12C² + 13C per block with biases (12C² + 2C
      without), C for the final norm (2C with a bias);
    - activations: ``activation_bytes`` of this rank's ``batch_size // world_size`` sequences;
    - the largest transient, of three moments of the backward (4 bytes a float, N this rank's
      tokens): the loss's backward, 3NV (the logits, the gradient into the log-softmax, the
      gradient out of it); a weight's gradient before it is added in, the largest weight (4C·C
      or V·C) under DDP, a block's whole gradients (its parameters) under FSDP2, before their
      reduce-scatter; and with ``checkpoint=True``, the recomputed block: its activations
      (N(16C + H + 4)), the logits (NV) and that weight's gradient;
    - stage 3 also holds gathered parameters whole: two blocks' (the one running and the next,
      prefetched; one if there is one block) and the root's (embeddings, final norm, head),
      which FSDP2 keeps gathered from its forward to its backward.

    ``offload=True`` is FSDP2 with ``CPUOffloadPolicy``: the shards, their gradients and AdamW's
    state live in the CPU's memory, so the peak to predict is the GPU's, which holds none of the
    state: activations + the largest transient + gathered.

    A ``stage`` other than 0 or 3, ``offload`` under a stage other than 3 (only FSDP2 offloads),
    ``world_size`` below 1, or a ``batch_size`` that does not split evenly over the ranks raises
    ``ValueError`` (as ``activation_bytes`` does for the rest).

    The test checks your sum, to the byte, against the one above for generated sizes (the
    parameters counted by torch, the activations by its saved-tensors hook); then trains the
    model on 1, 2 and 4 gloo ranks, DDP and FSDP2 (offloaded too, on 2), with and without
    checkpointing, on configurations where activations, the state or the loss dominate, and
    measures each rank's peak (``harness.memory``; offloaded, what the step adds beyond the
    state): the sum must be within 15 % of it (the reference's is within 6 %, 10 % in the runs
    where a reduce-scatter's buffers are freed late).
    """
    raise NotImplementedError("task5_9: state, activations, the largest transient, gathered")
# --8<-- [end:peak_bytes]


# --8<-- [start:zero_peak_bytes]
def zero_peak_bytes(config, batch_size: int, world_size: int = 1, stage: int = 1,
                    checkpoint: bool = False) -> int:
    """The most bytes one rank holds during a training step of the running example under this
    lesson's ``Zero1Optimizer`` (``stage=1``) or ``Zero2Optimizer`` (``stage=2``) wrapping
    AdamW, predicted: the model plain (no DDP), ``batch_size`` sequences split evenly over
    ``world_size`` ranks, as ``peak_bytes`` has them.

    These optimizers keep no gradient between steps (ZeRO-1's ``step()`` frees the whole
    gradients, ZeRO-2's frees its pieces), so only the parameters and this rank's share of the
    moments stay. The backward then trades activations for gradients, block by block: at its
    start the rank holds every activation and no gradient, at its end every gradient (whole
    under ZeRO-1, this rank's pieces under ZeRO-2) and no activation. Predict the peak at the
    larger end:

        held + max(activations + the largest of the start's moments,
                   G + the largest of the end's moments)

    with 4 bytes a float, N this rank's tokens, P the model's largest parameter (in elements):

    - held: ``memory_per_rank(Ψ, world_size, stage)``'s parameters and optimizer state (your
      task5_1; Ψ as in ``peak_bytes``); G: its gradients;
    - activations: ``activation_bytes`` of this rank's ``batch_size // world_size`` sequences;
    - R, one reduce-scatter of the largest parameter's gradient (your ``reduce_scatter_mean``):
      the gradient padded to ``world_size`` pieces and two pieces (this rank's sum and its
      mean), (W + 2)·⌈P/W⌉ floats; ZeRO-2 reduce-scatters inside the backward, as soon as a
      gradient is made, so its R holds that whole gradient too: P + (W + 2)·⌈P/W⌉. Beside it
      are the logits, which the caller holds through the step: R + NV;
    - the recomputed block, with ``checkpoint=True``: its activations and the logits,
      N(16C + H + 4 + V);
    - the start's moments: the loss's backward (3NV, as in ``peak_bytes``), the recomputed block
      (with checkpointing), and under ZeRO-2 R + NV;
    - the end's moments: R + NV (ZeRO-1's ``step()`` reduce-scatters after the backward), and
      the recomputed block (with checkpointing): the first block is recomputed last, beside
      nearly every gradient.

    A ``stage`` other than 1 or 2, ``world_size`` below 1, or a ``batch_size`` that does not
    split evenly over the ranks raises ``ValueError`` (as ``activation_bytes`` does for the rest).

    The test checks your sum, to the byte, against the one above for generated sizes (Ψ and P
    counted by torch, the activations by its saved-tensors hook); then trains the model with the
    reference's ``Zero1Optimizer`` and ``Zero2Optimizer`` on 2 gloo ranks, with and without
    checkpointing, on configurations where activations, the state or the loss
    dominate, and measures each rank's peak (``harness.memory``): the sum must be within 15 % of
    it (the reference's is within 0.91 to 1.04 times it).
    """
    raise NotImplementedError("task5_10: what stays, then the larger of the backward's two ends")
# --8<-- [end:zero_peak_bytes]
