"""Searches that decide settings by experiment (the DataLoaderTuner's `dataloader/`); callbacks are their hooks."""
