"""The running example: a small GPT-style language model over characters.

Built so that the later lessons can cut it without rewriting it:
- tensor parallel splits attention by heads: ``q_proj``/``k_proj``/``v_proj`` are column-parallel
  (a rank keeps whole heads' output features) and ``out_proj`` is row-parallel; the MLP's
  ``up_proj``/``down_proj`` likewise. ``forward`` reshapes to ``-1`` heads, so a rank holding
  ``n_head / world`` heads runs the same code;
- pipeline parallel cuts ``GPT.blocks`` (an ``nn.ModuleList``) between blocks: ``GPTStage`` is
  one run of blocks, with the embeddings or the head at the ends. The lm head is not tied to the
  token embedding, so the first and last stages share no weight;
- FSDP2 wraps each ``Block``, then the whole model;
- context parallel gives each rank some positions of every sequence: ``GPT.forward`` takes
  ``positions``, and each block's attention calls ``attend``, which lesson 10 replaces with
  attention across the ranks (a ring) while it trains.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Named sizes. Both have n_head and n_layer divisible by 2 and 4, so tensor and pipeline parallel
# lessons can split them 2 or 4 ways.
SIZES = {
    # 56k parameters, cheap enough for tests: one training step (batch 16, context 32) took
    # 20-30 ms on one thread of a busy 2-core machine.
    "tiny": dict(block_size=32, n_layer=4, n_head=4, n_embd=32),
    # 14M parameters: worth a GPU.
    "gpu": dict(block_size=256, n_layer=8, n_head=8, n_embd=384),
}


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 32  # context length: the most tokens the model attends over
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 32
    bias: bool = True
    dropout: float = 0.0  # > 0 draws from the global RNG in training mode

    @classmethod
    def named(cls, size: str = "tiny", *, vocab_size: int, **overrides) -> GPTConfig:
        """``GPTConfig.named("gpu", vocab_size=ds.vocab_size)``; keywords override the size."""
        return cls(vocab_size=vocab_size, **{**SIZES[size], **overrides})


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of q over k and v, all (B, heads, T, head_dim), in one process."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    # The attention itself, (q, k, v, dropout_p) -> y: lesson 10 sets a block's own while its
    # ranks each hold part of every sequence.
    attend = staticmethod(causal_attention)

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must split evenly into heads"
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        # Separate projections (not one fused qkv): each is split by heads on its own.
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim). -1 rather than n_head: under
        # tensor parallelism a rank holds only some of the heads.
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = self.attend(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.out_proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.down_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    """Pre-norm: normalise, transform, add back. The residual path itself is never normalised."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _local(tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part: a DTensor's local shard (a view: writing it writes the parameter), or,
    with ``like``, this rank's piece of the whole ``tensor`` as ``like`` is sharded, cut by
    DTensor's own rule on every rank (``src_data_rank=None``: no communication). A plain tensor
    is all of it. (A whole plain tensor copied into the DTensor itself under
    ``implicit_replication()`` raises where the parameter has fewer rows than ranks.)"""
    if like is not None and hasattr(like, "placements"):
        from torch.distributed.tensor import distribute_tensor

        tensor = distribute_tensor(tensor, like.device_mesh, like.placements, src_data_rank=None)
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        # nn.Linear and nn.Embedding initialise themselves from the global RNG, which ranks
        # sharing a process also use: fork_rng puts its state back afterwards, and init_weights
        # overwrites every value from a generator of our own. (Not the meta device: building an
        # nn.Embedding there imports torch._dynamo, 3 s per process.)
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
            self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 init: normal(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).

        Each output projection adds to the residual stream, 2 per block; the scaling keeps the
        stream's variance from growing with depth. Values are drawn where the generator lives
        (a CPU one: the default) and copied, so a seed gives the same model on every device.
        Into a sharded parameter (a DTensor) each rank draws the whole and copies its own piece
        into its local shard, even where the parameter has fewer rows than ranks.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                _local(module.weight).fill_(1.0)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("out_proj", "down_proj")) else 0.02
                values = torch.randn(module.weight.shape, generator=generator,
                                     device=generator.device)
                _local(module.weight).copy_(_local(values * std, like=module.weight))
            if getattr(module, "bias", None) is not None:
                _local(module.bias).zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab) and the mean loss.
        ``positions`` (T,): where idx's tokens sit in their sequence, 0 to T - 1 unless given
        (lesson 10's ranks each hold some positions of every sequence)."""
        T = idx.shape[1]
        assert T <= self.config.block_size, f"{T} tokens > block_size {self.config.block_size}"
        if positions is None:
            positions = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int,
                 generator: torch.Generator | None = None, temperature: float = 1.0):
        """Append ``max_new_tokens`` tokens to idx (B, T); temperature 0 takes the likeliest."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])  # the model sees block_size at most
            logits = logits[:, -1, :]
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                # Sample where the generator lives: a CPU generator cannot drive CUDA sampling.
                where = generator.device if generator is not None else probs.device
                next_id = torch.multinomial(probs.to(where), 1, generator=generator)
            idx = torch.cat([idx, next_id.to(idx.device)], dim=1)
        return idx

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class GPTStage(nn.Module):
    """Blocks ``start`` to ``end - 1`` of ``model``: one stage of a pipeline (lesson 07).

    The first stage (``start == 0``) also runs the embeddings, the last (``end == n_layer``) the
    final norm and the head, so that chaining the stages of a cut computes ``model``'s logits.
    It keeps the model's own modules, not copies: training a stage trains the model.
    """

    def __init__(self, model: GPT, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= len(model.blocks):
            raise ValueError(f"blocks {start} to {end - 1} are not a stage of a model of "
                             f"{len(model.blocks)} blocks")
        self.first, self.last = start == 0, end == len(model.blocks)
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[start:end])
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, else activations (B, T, C); logits (B, T,
        vocab) from the last stage, else activations."""
        if self.first:
            x = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1],
                                                                      device=x.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def parameter_digest(model: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """sha256 of every parameter and buffer's name, dtype, shape and exact bytes.

    Two runs that end with the same digest trained bit-for-bit the same model. Pass the model
    itself, not a wrapper (``ddp_model.module``), so the names carry no ``module.`` prefix, or a
    state dict of plain tensors (a sharded model's, gathered whole).
    """
    digest = hashlib.sha256()
    state = model.state_dict() if isinstance(model, nn.Module) else model
    for name, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    return digest.hexdigest()
