"""Runnable examples: a byte-level GPT on the standard library's source and an MLP on scikit-learn's digits."""

from __future__ import annotations

from lightning_accel.examples.digits import DigitsClassifier, DigitsDataModule
from lightning_accel.examples.gpt import Block, GPTLanguageModel
from lightning_accel.examples.text_data import StdlibTextDataModule

__all__ = ["Block", "DigitsClassifier", "DigitsDataModule", "GPTLanguageModel", "StdlibTextDataModule"]
