"""Compile: `torch.compile` of the LightningModule's forward (or of each block, through Parallelize), from config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.parallel.blocks import COMPILE_MODES
from lightning_accel.system.software import compile_problem

__all__ = ["COMPILE_MODES", "Compile"]

"""`torch.compile(mode=...)` values."""
_REFUSED = {
    "PipelineStrategy": "the pipeline runner splits the model into stages",
    "DeepSpeedStrategy": "DeepSpeed wraps the model in its own engine",
    "FSDPStrategy": "FSDP1 flattens the parameters (use strategy=model_parallel: FSDP2 with compile per block)",
}


class Compile(Callback):
    """`torch.compile` the model being trained: the LightningModule's `forward` in place (`Module.compile`, so the
    module keeps its class, hooks and checkpoint keys) on one device or under DDP; under ModelParallelStrategy each
    block, by switching on the `Parallelize` callback's `compile` (FSDP2 wraps compiled blocks, as torchtitan does).

    `training_step` must reach the model through `self(...)` (or its compiled submodules) for the compiled graph to
    run. The first batches compile (and a new shape, such as a shorter last batch or eval mode, compiles again):
    `BenchMonitor` and accel-bench leave those batches out of throughput. The compile is undone at teardown.

    Keeps identical: the model's math up to the compiled kernels' rounding (`backend="eager"`: bit for bit; the zoo).
    Changes on purpose: how the forward runs (torch.compile), undone at teardown.
    Cannot serve: a `training_step` that never calls the module itself (`self(...)`) but a submodule
        (`self.model(...)`) or `self.forward(...)` directly: nothing runs compiled, and it warns at the first optimizer
        step; pipeline, DeepSpeed and FSDP1 strategies are refused.

    Logs:
        nothing; the compile is reported at INFO.

    Args:
        mode: `torch.compile(mode=...)`: "default", "reduce-overhead" (CUDA graphs), "max-autotune",
            "max-autotune-no-cudagraphs"; None: torch's default.
        fullgraph: refuse graph breaks (an error instead of falling back to Python).
        dynamic: None (torch decides after a recompile), True or False.
        backend: "inductor" (the default), or "aot_eager"/"eager" to find what breaks without building kernels.

    Raises:
        ConfigError: for a bad option; at setup, with a strategy that cannot compile this way (pipeline, DeepSpeed,
            FSDP1), under model_parallel without Parallelize, or when inductor has no compiler to build with.

    Example::

        trainer = Trainer(callbacks=[Compile(mode="max-autotune")])
    """

    @classmethod
    def check_run(cls, *, family: str, on_cuda: bool, block_classes: bool, settings: Mapping[str, Any]) -> None:
        """This callback's rule for a run, asked before launch: a strategy it can compile under (model parallel only
        through block classes), and the compiler inductor builds kernels with.

        Raises:
            ConfigError: for pipeline, FSDP1 or DeepSpeed, model parallel without block classes, or no compiler.
        """
        if family in ("pipeline", "deepspeed", "fsdp"):
            fix = "strategy=model_parallel (FSDP2, compiled per block)" if family == "fsdp" else "strategy=ddp"
            raise ConfigError(
                f"(Compile, `compile=...`) cannot compile the model under `strategy={family}`; use "
                f"`compile=none` with it, or {fix}."
            )
        if family == "model_parallel" and not block_classes:
            raise ConfigError(
                "(Compile) under `strategy=model_parallel` compiles each block through "
                "`callbacks.parallelize`, which names no `block_classes`; set the model config's "
                "`parallel_plan.block_classes`, or use `compile=none`."
            )
        problem = compile_problem(str(settings.get("backend", "inductor")), on_cuda=on_cuda)
        if problem:
            raise ConfigError(f"(Compile): {problem}; or use `compile=none`.", setting="backend")

    def __init__(
        self,
        mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = "default",
        *,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str = "inductor",
    ) -> None:
        if mode is not None and mode not in COMPILE_MODES:
            raise ConfigError(
                f"`mode={mode!r}` is not a torch.compile mode; use one of {', '.join(COMPILE_MODES)} or None.",
                setting="mode",
            )
        for name, value in (("fullgraph", fullgraph), ("dynamic", dynamic)):
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"`{name}={value!r}` must be true or false.", setting=name)
        if fullgraph is None:
            raise ConfigError("`fullgraph=None` must be true or false.", setting="fullgraph")
        if not isinstance(backend, str) or not backend:
            raise ConfigError(
                f"`backend={backend!r}` must name a torch.compile backend, e.g. 'inductor'.", setting="backend"
            )
        self.mode, self.fullgraph, self.dynamic, self.backend = mode, fullgraph, dynamic, backend
        self._compiled: pl.LightningModule | None = None
        self._calls = 0  # calls of the compiled module itself this fit
        self._checked = True  # the first optimizer step saw whether training called it

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `torch.compile` this callback passes."""
        kwargs: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend}
        if self.mode is not None and self.backend == "inductor":
            kwargs["mode"] = self.mode
        return kwargs

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        from lightning_accel.strategies.pipeline import PipelineStrategy

        pipeline = isinstance(trainer.strategy, PipelineStrategy)
        strategy = "PipelineStrategy" if pipeline else type(trainer.strategy).__name__
        if strategy in _REFUSED:
            raise ConfigError(
                f"Compile cannot compile the model under {strategy}: {_REFUSED[strategy]}. Use `compile=none` with "
                "it, or strategy=ddp / model_parallel.",
                setting="strategy",
            )
        problem = compile_problem(self.backend, on_cuda=trainer.strategy.root_device.type == "cuda")
        if problem:
            raise ConfigError(f"Compile: {problem}; or use `compile=none`.", setting="backend")
        from lightning_accel.callbacks.parallelize import Parallelize

        parallelize = next((cb for cb in _lightning.trainer_callbacks(trainer) if isinstance(cb, Parallelize)), None)
        if isinstance(trainer.strategy, ModelParallelStrategy):
            if parallelize is None or not parallelize.block_classes:
                raise ConfigError(
                    "Under ModelParallelStrategy, Compile compiles each block through the Parallelize callback "
                    "(FSDP2 wraps compiled blocks); add Parallelize(block_classes=[...]) (accel-train: the model "
                    "config's parallel_plan.block_classes), or use `compile=none`.",
                    setting="strategy",
                )
            parallelize.compile, parallelize.compile_mode = True, self.mode if self.backend == "inductor" else None
            blocks = ", ".join(c if isinstance(c, str) else c.__qualname__ for c in parallelize.block_classes)
            rank_zero_info(f"Compile: each {blocks} block through Parallelize (mode={self.mode}).")
            return
        pl_module.compile(**self.compile_kwargs())
        self._compiled, self._calls, self._checked = pl_module, 0, False
        compiled_call = pl_module._compiled_call_impl
        assert compiled_call is not None, "Module.compile sets the compiled call"

        def counted_call(*args: Any, **kwargs: Any) -> Any:  # outside the graph: counts the module's own calls
            self._calls += 1
            return compiled_call(*args, **kwargs)

        pl_module._compiled_call_impl = counted_call
        rank_zero_info(f"Compile: {type(pl_module).__name__}.forward with torch.compile({self.compile_kwargs()}).")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._checked or self._compiled is None:
            return
        self._checked = True
        if self._calls == 0:
            rank_zero_warn(
                f"Compile: the first training step never called the {type(pl_module).__name__} itself, so nothing ran "
                "compiled: `training_step` reaches the model another way (a submodule, `self.model(...)`, or "
                "`self.forward(...)` called directly). Call `self(...)` in `training_step`, or compile the submodule "
                "in your own `configure_model` (`self.model.compile()`) and remove Compile.",
                category=LightningAccelWarning,
            )

    def _undo(self) -> None:
        if self._compiled is not None:
            self._compiled._compiled_call_impl = None  # what Module.compile set: the module runs eagerly again
            self._compiled = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._undo()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._undo()
