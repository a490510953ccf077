"""The template's MNISTDataModule with the download replaced: scikit-learn's 1,797 bundled 8x8 digits, scaled to
MNIST's 1x28x28 and normalised alike, so the template's model and configs run unchanged and offline. Like the
template's, it divides `batch_size` by the world size and takes no `persistent_workers`."""

from typing import Any

import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split


class DigitsDataModule(LightningDataModule):
    def __init__(
        self,
        batch_size: int = 64,
        train_val_test_split: tuple[int, int, int] = (1_397, 200, 200),
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None
        self.data_test: Dataset | None = None
        self.batch_size_per_device = batch_size

    @property
    def num_classes(self) -> int:
        return 10

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:  # the template's division of the batch by the world size
            if self.hparams.batch_size % self.trainer.world_size != 0:
                raise RuntimeError(
                    f"Batch size ({self.hparams.batch_size}) is not divisible by the number of "
                    f"devices ({self.trainer.world_size})."
                )
            self.batch_size_per_device = self.hparams.batch_size // self.trainer.world_size
        if not self.data_train and not self.data_val and not self.data_test:
            from sklearn.datasets import load_digits

            digits = load_digits()
            images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
            images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
            images = (images - 0.1307) / 0.3081
            dataset = TensorDataset(images, torch.tensor(digits.target, dtype=torch.long))
            self.data_train, self.data_val, self.data_test = random_split(
                dataset=dataset,
                lengths=self.hparams.train_val_test_split,
                generator=torch.Generator().manual_seed(42),
            )

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader[Any]:
        return DataLoader(
            dataset=dataset,
            batch_size=self.batch_size_per_device,
            num_workers=self.hparams.num_workers,
            pin_memory=self.hparams.pin_memory,
            shuffle=shuffle,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.data_train, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.data_val, shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.data_test, shuffle=False)

    def state_dict(self) -> dict[Any, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
