"""scikit-learn's bundled 8x8 handwritten digits and a small MLP classifier for them; no download needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_accel import schedules
from lightning_accel.examples._settings import check_split_settings

__all__ = ["DigitsClassifier", "DigitsDataModule"]

_INSTALL_HINT = "The digits example needs scikit-learn; install it with `pip install 'lightning_accel[digits]'`."


def _load_digits() -> tuple[Any, Any]:
    """The 1,797 digit images as `(features, labels)`, importing scikit-learn only now."""
    try:
        import sklearn  # noqa: F401  (imported first so a blocked or missing top-level package fails here)
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ModuleNotFoundError(_INSTALL_HINT) from err
    data = load_digits()
    return data.data, data.target


def _split(labels: Any, val_fraction: float, test_fraction: float, seed: int | None) -> tuple[Any, Any, Any]:
    """Stratified, seeded train/val/test index arrays."""
    from sklearn.model_selection import train_test_split

    indices = list(range(len(labels)))
    rest, test = train_test_split(indices, test_size=test_fraction, stratify=labels, random_state=seed)
    val_share = val_fraction / (1.0 - test_fraction)
    train, val = train_test_split(rest, test_size=val_share, stratify=labels[rest], random_state=seed)
    return train, val, test


class DigitsDataModule(pl.LightningDataModule):
    """The 8x8 digits of scikit-learn (1,797 images, 10 classes), split stratified and scaled to [0, 1].

    Each item is `(x, y)`: `x` a float32 vector of 64 pixel intensities divided by 16, `y` the int64 class.

    Args:
        batch_size: images per batch.
        val_fraction: share of the images held out for validation.
        test_fraction: share of the images held out for testing.
        num_workers: DataLoader worker processes.
        pin_memory: pin host batches for faster copies to the GPU.
        persistent_workers: keep workers alive between epochs; only used when `num_workers > 0`.
        seed: seed of the split and of the training shuffle; None draws both from the global RNGs (`seed=null`).

    Raises:
        ValueError: for a non-positive batch size, negative workers or fractions outside (0, 1) summing to 1 or more.
        ModuleNotFoundError: at `setup` when scikit-learn is not installed.
    """

    num_features: int = 64
    num_classes: int = 10

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        check_split_settings(val_fraction, test_fraction, num_workers, batch_size=batch_size)
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    @override
    def prepare_data(self) -> None:
        _load_digits()  # fails early, with the install hint, when scikit-learn is missing

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        features, labels = _load_digits()
        x = torch.as_tensor(features, dtype=torch.float32) / 16.0
        y = torch.as_tensor(labels, dtype=torch.long)
        train, val, test = _split(labels, self.val_fraction, self.test_fraction, self.seed)
        self.train_set, self.val_set, self.test_set = (TensorDataset(x[i], y[i]) for i in (train, val, test))

    def _loader(self, dataset: TensorDataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("`DigitsDataModule.setup()` must run before asking for a dataloader.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            generator=torch.Generator().manual_seed(self.seed) if train and self.seed is not None else None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)


class DigitsClassifier(pl.LightningModule):
    """An MLP over flattened 8x8 digits: `n_layer` hidden layers of Linear, GELU and dropout, then a linear head.

    Logged metrics:
        - `train/loss`, `train/acc`: cross-entropy (nats) and accuracy (fraction correct), every step.
        - `val/loss`, `val/acc`, `test/loss`, `test/acc`: the same, averaged over the epoch across ranks.

    Args:
        input_dim: features per example.
        num_classes: number of classes.
        hidden_dim: width of each hidden layer.
        n_layer: number of hidden layers.
        dropout: dropout after each hidden activation.
        optimizer: a partial called as `optimizer(params)`; None gives `AdamW(lr=1e-3)`.
        lr_scheduler: a partial called as `lr_scheduler(optimizer, total_steps=...)`, stepped every optimizer step.

    Raises:
        ValueError: for a non-positive size, fewer than two classes or dropout outside [0, 1).
    """

    def __init__(
        self,
        input_dim: int = 64,
        num_classes: int = 10,
        hidden_dim: int = 128,
        n_layer: int = 2,
        dropout: float = 0.1,
        optimizer: Callable[..., Any] | None = None,
        lr_scheduler: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("input_dim", input_dim), ("hidden_dim", hidden_dim), ("n_layer", n_layer)):
            if value < 1:
                raise ValueError(f"`model.{name}={value}` must be >= 1.")
        if num_classes < 2:
            raise ValueError(f"`model.num_classes={num_classes}` must be >= 2.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`model.dropout={dropout}` must be within [0, 1).")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        layers: list[nn.Module] = []
        width = input_dim
        for _ in range(n_layer):
            layers += [nn.Linear(width, hidden_dim), nn.GELU(), nn.Dropout(dropout)]
            width = hidden_dim
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of shape `(batch, num_classes)` for `x` of shape `(batch, input_dim)`."""
        return self.net(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_epoch=True, sync_dist=True, prog_bar=True)

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test/loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.log("test/acc", self.test_acc, on_epoch=True, sync_dist=True)

    def flops_per_batch(self, batch_size: int) -> int:
        """Estimated FLOPs of one forward and backward pass over `batch_size` examples: `6 * params * batch_size`."""
        return 6 * sum(p.numel() for p in self.parameters()) * batch_size

    @override
    def configure_optimizers(self) -> Any:
        return schedules.configure_optimizers(self, self.optimizer, self.lr_scheduler)
