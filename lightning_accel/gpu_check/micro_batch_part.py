"""`micro_batch`: MicroBatchFinder under a 3 GiB cap: sized from real CUDA out-of-memory errors and peaks,
an injected allocator OOM recovered by halving, the weights equal to a fixed micro-batch of 8's."""

from __future__ import annotations

import time

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, need_cuda
from lightning_accel.gpu_check.gpt_fits import gpt_class, next_byte_pairs

__all__ = ["check_micro_batch"]


def check_micro_batch(ctx: CheckContext) -> Part:
    need_cuda()
    import lightning.pytorch as pl

    from lightning_accel.callbacks import MicroBatchFinder

    cap = 3 * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    gpt = gpt_class()

    class _SGD(gpt):  # type: ignore[misc, valid-type]  # a base class found at run time
        """Plain SGD: the weights then differ by what the gradients differ (Adam's first steps amplify rounding)."""

        def configure_optimizers(self) -> object:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class _OOMOnce(_SGD):
        """A real CUDA out-of-memory error from the allocator, once, in the first piece after the sizing ended."""

        finder: MicroBatchFinder | None = None
        injected = False

        def training_step(self, batch: object, batch_idx: int) -> object:
            if self.finder is not None and self.finder.found is not None and not self.injected:
                self.injected = True
                torch.empty(total, dtype=torch.uint8, device="cuda")  # more than the cap: raises OutOfMemoryError
            return super().training_step(batch, batch_idx)

    data = torch.randint(0, 256, (6 * 128, 257), generator=torch.Generator().manual_seed(0))
    pairs = next_byte_pairs(data)
    runs = {}
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    try:
        for name, finder in (("auto", MicroBatchFinder(grow_after=None)), ("fixed 8", MicroBatchFinder(8))):
            pl.seed_everything(0)
            model = (_OOMOnce if name == "auto" else _SGD)(block_size=256, n_layer=4, n_head=8, n_embd=512)
            if isinstance(model, _OOMOnce):
                model.finder = finder
            trainer = pl.Trainer(
                accelerator="cuda",
                devices=1,
                max_steps=6,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[finder],
            )
            started = time.perf_counter()
            trainer.fit(model, torch.utils.data.DataLoader(pairs, batch_size=128))
            runs[name] = (finder, time.perf_counter() - started, [p.detach().float().cpu() for p in model.parameters()])
            del model, trainer
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    finder, seconds, weights = runs["auto"]
    drift = max(float((a - b).abs().max()) for a, b in zip(weights, runs["fixed 8"][2], strict=True))
    trials = ", ".join(
        f"{t.size}: {'fits' if t.fits else 'no'}" + (f" ({t.peak_bytes / 2**30:.2f} GiB)" if t.peak_bytes else "")
        for t in finder.sizing
    )
    # >= 1: a real OOM of its own during training (the cap limits reserved memory, fragmentation included) is fine
    ok = finder.found is not None and finder.found < 128 and finder.oom_recoveries >= 1 and drift <= 1e-3
    ok = ok and finder.found is not None and finder.size is not None and finder.size <= finder.found // 2
    return Part(
        name="micro_batch",
        status="PASS" if ok else "FAIL",
        detail=f"cap {cap / 2**30:.0f} GiB, GPT 4x512, block 256, batch 128, 6 steps",
        figures={
            "micro-batch found": str(finder.found),
            "sizing steps": trials,
            "after the injected OOM": f"{finder.size} ({finder.oom_recoveries} recoveries)",
            "max |w_auto - w_fixed8|": f"{drift:.2e}",
            "fit s (auto, fixed 8)": f"{seconds:.1f}, {runs['fixed 8'][1]:.1f}",
        },
    )
