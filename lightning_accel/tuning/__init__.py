"""Searches that decide settings by experiment (the DataLoaderTuner's `dataloader/`); callbacks are their hooks."""

__all__: list[str] = []  # the searches live in their subpackages (dataloader/)
