"""A small GPT-style causal byte language model built from identical blocks, ready to shard, split and parallelize."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_accel import schedules

__all__ = ["Block", "CausalSelfAttention", "GPTLanguageModel", "MLP"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate query, key, value and output projections.

    `q_proj`, `k_proj` and `v_proj` can be sharded column-wise and `out_proj` row-wise for tensor parallelism: the
    head count is read from the local `q_proj` output, so a shard that holds fewer heads runs unchanged.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_embd)
        self.k_proj = nn.Linear(n_embd, n_embd)
        self.v_proj = nn.Linear(n_embd, n_embd)
        self.out_proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        n_local_heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(batch, seq, n_local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, n_local_heads * self.head_dim)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """The feed-forward half of a block: `fc` (column-wise shardable), GELU, `proj` (row-wise shardable)."""

    def __init__(self, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`; the unit to shard or stage."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTLanguageModel(pl.LightningModule):
    """A GPT-style causal language model (nanoGPT's layout, untied embeddings) trained on next-token loss.

    The model is `tok_emb` + `pos_emb`, then `blocks` (an `nn.ModuleList` of identical `Block`s), `ln_f` and
    `lm_head`, so per-block sharding (FSDP2), tensor-parallel plans over the named linears and pipeline cuts
    between blocks need no model changes.

    Logged metrics:
        - `train/loss`: cross-entropy in nats per token, every step (progress bar).
        - `val/loss`, `test/loss`: cross-entropy in nats per token, averaged over the epoch across ranks.
        - `val/bpc`, `test/bpc`: the same in bits per character (`loss / ln 2`); for bytes, a character is a byte.

    Args:
        vocab_size: number of token ids (256 for bytes).
        block_size: the longest context, in tokens; sizes the position embedding.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide `n_embd`.
        n_embd: width of the residual stream.
        dropout: dropout on attention weights and residual branches.
        optimizer: a partial called as `optimizer(param_groups)`; None gives `AdamW(lr=1e-3)`. Its
            `weight_decay` keyword, when set, applies to weights of two or more dimensions only.
        lr_scheduler: a partial called as `lr_scheduler(optimizer, total_steps=...)`, stepped every optimizer step.
        device_memory_samples: simulate a device that holds the activations of at most this many sequences per
            training forward: a larger batch raises `torch.OutOfMemoryError`, as CUDA would, so `micro_batch=auto`
            and accel-tune's memory moves can be tried on a CPU. None: no limit.
        vocab_multiple_of: size the embedding and the logits to `vocab_size` rounded up to a multiple of this, as
            nanoGPT pads GPT-2's 50,257 tokens to 50,304: tensor-core matmuls tile evenly. The extra ids never
            occur in the data; their logits are trained down like any wrong token's. 1: no padding.

    Raises:
        ValueError: for a non-positive size, `n_embd` not divisible by `n_head`, or dropout outside [0, 1).

    Example::

        model = GPTLanguageModel(n_layer=4, optimizer=functools.partial(torch.optim.AdamW, lr=3e-3))
        logits = model(torch.randint(0, 256, (8, 64)))  # (8, 64, 256)
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        optimizer: Callable[..., Any] | None = None,
        lr_scheduler: Callable[..., Any] | None = None,
        device_memory_samples: int | None = None,
        vocab_multiple_of: int = 1,
    ) -> None:
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "block_size": block_size,
            "n_layer": n_layer,
            "n_head": n_head,
            "vocab_multiple_of": vocab_multiple_of,
        }
        for name, value in {**sizes, "n_embd": n_embd}.items():
            if value < 1:
                raise ValueError(f"`model.{name}={value}` must be >= 1.")
        if n_embd % n_head != 0:
            raise ValueError(
                f"`model.n_embd={n_embd}` must be divisible by `model.n_head={n_head}`; pick an `n_head` among "
                f"{[h for h in range(1, n_embd + 1) if n_embd % h == 0][:8]}."
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`model.dropout={dropout}` must be within [0, 1).")
        if device_memory_samples is not None and device_memory_samples < 1:
            raise ValueError(f"`model.device_memory_samples={device_memory_samples}` must be >= 1, or null.")
        self.device_memory_samples = device_memory_samples
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.block_size = block_size

        self.padded_vocab_size = -(-vocab_size // vocab_multiple_of) * vocab_multiple_of
        self.tok_emb = nn.Embedding(self.padded_vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, self.padded_vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attn.out_proj.weight", "mlp.proj.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        embedding_params = self.tok_emb.weight.numel() + self.pos_emb.weight.numel()
        self.num_params_nonembedding = sum(p.numel() for p in self.parameters()) - embedding_params

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape `(batch, seq, padded_vocab_size)` for token ids `idx` of shape `(batch, seq)`.

        On a pipeline stage (`strategy=pipeline`) the modules of other stages are None: without `tok_emb` the input is
        the residual stream `(batch, seq, n_embd)`, and without `lm_head` the residual stream is returned.
        """
        limit = self.device_memory_samples
        if limit is not None and self.training and torch.is_grad_enabled() and idx.shape[0] > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated by model.device_memory_samples={limit}): a forward of {idx.shape[0]} "
                "sequences does not fit"
            )
        seq = idx.shape[1]
        if seq > self.block_size:
            raise ValueError(
                f"A sequence of {seq} tokens is longer than `model.block_size={self.block_size}`; "
                "crop the input or raise `model.block_size`."
            )
        x = idx
        if self.tok_emb is not None:
            pos = torch.arange(seq, device=idx.device)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.ln_f(x))

    # The block list strategy=pipeline splits into stages (modules registered before it go to the first stage).
    pipeline_blocks = "blocks"

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats per token) of `logits` against `targets`; the pipeline's loss_fn."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def log_loss(self, stage: str, loss: torch.Tensor) -> None:
        """Log a step's loss as `{stage}/loss` (and `{stage}/bpc` for val and test); strategy=pipeline calls it too."""
        if stage == "train":
            self.log("train/loss", loss, on_step=True, prog_bar=True)
            return
        self.log(f"{stage}/loss", loss, on_epoch=True, sync_dist=True, prog_bar=stage == "val")
        self.log(f"{stage}/bpc", loss / math.log(2), on_epoch=True, sync_dist=True)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log_loss("train", loss)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log_loss("val", self._loss(batch))

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log_loss("test", self._loss(batch))

    def flops_per_batch(self, batch_size: int) -> int:
        """Estimated FLOPs of one forward and backward pass over `batch_size` sequences of `block_size` tokens.

        Uses the PaLM / nanoGPT estimate per token, `6 * N + 12 * n_layer * n_embd * block_size`, where `N` counts
        the parameters outside the two embedding tables (lookups do no multiply-adds) and the second term is the
        attention score and value products. Causal masking is not discounted, as in those references.
        """
        hp = self.hparams
        tokens = batch_size * hp["block_size"]
        per_token = 6 * self.num_params_nonembedding + 12 * hp["n_layer"] * hp["n_embd"] * hp["block_size"]
        return int(per_token * tokens)

    def param_groups(self) -> list[dict[str, Any]]:
        """Two optimizer groups: weights of two or more dimensions decay, biases and LayerNorm gains do not."""
        weight_decay = float(getattr(self.optimizer, "keywords", {}).get("weight_decay", 0.0))
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    @override
    def configure_optimizers(self) -> Any:
        return schedules.configure_optimizers(self, self.optimizer, self.lr_scheduler, params=self.param_groups())
