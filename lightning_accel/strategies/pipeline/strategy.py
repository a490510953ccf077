"""PipelineStrategy: pipeline parallelism (torch.distributed.pipelining) inside the Lightning Trainer's own loop."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import timedelta
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError
from lightning_accel.files import PathLike
from lightning_accel.patching import patch_attribute
from lightning_accel.strategies.pipeline.checkpoint import (
    load_pipeline_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_pipeline_checkpoint,
)
from lightning_accel.strategies.pipeline.pipeline_settings import DEFAULTS, PipelineSettings
from lightning_accel.strategies.pipeline.runner import PipelineRunner, PipelineStepResult, clip_grad_norm_over_stages
from lightning_accel.strategies.pipeline.spec import check_torch_pipelining
from lightning_accel.strategies.pipeline.stages import (
    PipelineStagePlan,
    check_microbatches,
    microbatches_for,
    plan_pipeline_stages,
    prune_to_stages,
    shard_stages,
    stage_ranks,
)

__all__ = ["PipelineStrategy"]


class PipelineStrategy(_LightningModelParallelStrategy):
    """Pipeline parallelism for the Trainer: the model is cut into stages between its blocks, one or more per rank.

    Every rank builds the whole LightningModule; `setup` keeps only the blocks (and the modules registered before the
    block list, on the first stage, or after it, on the last) its stages run, as torchtitan splits its models without
    a tracer, so parameter names stay the plain model's. `training_step` runs one `schedule.step` per batch:
    forward and backward of all micro-batches through all stages. The loss, which exists on the last stage only, is
    broadcast over the pipeline, so `self.log`, the progress bar, callbacks and checkpoint monitors see the same
    value on every rank. Validation and test run the same stages forward only. Optimizers, LR schedulers, gradient
    clipping (the norm is taken over all stages) and accumulation work as in any Lightning run.

    Micro-batches are not accumulation: a batch of B sequences is cut into `n_microbatches` pieces that are in
    flight on different stages at the same time, and their gradients add up to the batch's gradient in one
    optimizer step (the loss of each micro-batch is scaled so their sum is the batch mean). Accumulation
    (`accumulate_grad_batches`, `AccumulationScheduler`) still adds several such batches per optimizer step, one
    after another. Micro-batches fill the pipeline (the bubble is about `(stages - 1) / (n_microbatches + stages - 1)`
    of a GPipe or 1F1B step); accumulation does not.

    The LightningModule provides:
        - its blocks as an `nn.ModuleList` attribute, named by `block_list` or its `pipeline_blocks` attribute;
        - a `forward` that skips top-level modules that are None (a stage without the embeddings gets the hidden
          state, a stage without the head returns it);
        - `pipeline_loss(output, target)`: the mean loss of one micro-batch;
        - optionally `pipeline_inputs(batch) -> (args, target)` (default: `(batch[0],), batch[1]`) and
          `log_loss(stage, loss)` to log the loss under its own names (default: `{stage}/loss`). Its own
          `training_step`, `validation_step` and `test_step` are not called under this strategy.

    Data parallelism: `data_parallel_size` replicas of the whole pipeline on a `(pipeline_parallel, data_parallel)`
    mesh; each replica reads its share of the data, and gradients are averaged over the replicas (`replicate`) or
    each stage is sharded with FSDP2 (`fsdp`, `reshard_after_forward=False`).

    Checkpoints are directories written with torch.distributed.checkpoint: each stage writes its slice under the
    plain model's names. `lightning_accel.strategies.consolidate_checkpoint` joins them into the plain model's
    state dict.

    Differences from a plain run: `on_before_backward` and `on_after_backward` run after the schedule's backward
    (gradients are in place by `on_after_backward`, as usual); the V-shaped schedules (zbv_zero_bubble, dualpipev)
    evaluate the whole batch stage after stage, as torch's cannot run them forward only; `trainer.predict` is not
    supported (consolidate the checkpoint and predict with the plain model).

    Args:
        schedule: one of gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble,
            dualpipev (the last four where the installed torch has them).
        n_microbatches: micro-batches per batch; the batch size must divide by it. None: the number of stages.
        split_points: module names where stages 2.. begin (e.g. `["blocks.2"]`); None splits the block list evenly.
        n_stages: number of stages for an even split; None: pipeline ranks x the schedule's stages per rank.
        data_parallel_size: pipeline replicas; the pipeline size is the world size divided by it.
        data_parallel: "replicate" (all-reduce gradients) or "fsdp" (FSDP2 per stage).
        block_list: attribute name of the model's block list; None reads the module's `pipeline_blocks`.
        process_group_backend: None picks NCCL on CUDA and gloo on CPU.
        timeout: of collective operations.

    The arguments are kept, checked, as `settings` (a `PipelineSettings`).

    Raises:
        ConfigError: naming the argument (`err.setting`). Here: an unknown schedule or one this torch lacks, a
            non-positive size, `n_stages` that disagrees with `split_points`. When the Trainer starts: stages that the
            schedule cannot place on the pipeline ranks, an unsupported precision, manual optimization, a split point
            that does not exist, more stages than blocks, a batch that does not divide into micro-batches. A
            `ConfigTypeError` for a value of the wrong type.

    Example::

        trainer = Trainer(devices=2, strategy=PipelineStrategy(schedule="1f1b", n_microbatches=4))
        trainer.fit(GPTLanguageModel(n_layer=4), datamodule)
    """

    def __init__(
        self,
        schedule: str = DEFAULTS.schedule,
        n_microbatches: int | None = DEFAULTS.n_microbatches,
        split_points: Sequence[str] | None = DEFAULTS.split_points,
        n_stages: int | None = DEFAULTS.n_stages,
        data_parallel_size: int = DEFAULTS.data_parallel_size,
        data_parallel: Literal["replicate", "fsdp"] = DEFAULTS.data_parallel,
        block_list: str | None = DEFAULTS.block_list,
        process_group_backend: str | None = DEFAULTS.process_group_backend,
        timeout: timedelta | None = DEFAULTS.timeout,
    ) -> None:
        check_torch_pipelining()
        settings = PipelineSettings(
            schedule=schedule,
            n_microbatches=n_microbatches,
            split_points=cast("tuple[str, ...] | None", split_points),  # PipelineSettings makes any list a tuple
            n_stages=n_stages,
            data_parallel_size=data_parallel_size,
            data_parallel=data_parallel,
            block_list=block_list,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        settings.validate()
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.settings = settings
        self.plan: PipelineStagePlan | None = None
        self.local_stages: list[int] = []
        self._views: list[nn.Module] = []
        self._n_microbatches: int | None = None
        self._runner: PipelineRunner | None = None
        self._step_result: PipelineStepResult | None = None  # training_step's, until Lightning calls backward
        self._patches = ExitStack()  # undos of what this strategy patched; closed in teardown and on_exception

    # -- the mesh ------------------------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        _lightning.setup_distributed(self)
        self.settings.validate(world=self.world_size, precision=str(self.precision_plugin.precision))
        world, dp = self.world_size, self.settings.data_parallel_size
        self._device_mesh = init_device_mesh(
            self.root_device.type, (world // dp, dp), mesh_dim_names=("pipeline_parallel", "data_parallel")
        )
        assert self.lightning_module is not None
        _lightning.set_module_device_mesh(self.lightning_module, self._device_mesh)

    @property
    def pp_size(self) -> int:
        return self.device_mesh["pipeline_parallel"].size()

    @property
    def pp_rank(self) -> int:
        return self.device_mesh["pipeline_parallel"].get_local_rank()

    # -- stages --------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        module = self.lightning_module
        assert module is not None
        self.accelerator.setup(trainer)
        _check_module(module)
        if self.plan is None:  # a second setup (test after fit) keeps the stages it built
            self._build_stages(module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        assert self.plan is not None and self._n_microbatches is not None
        spec = self.settings.spec
        self._runner = PipelineRunner(
            module=module,
            views=self._views,
            stages=self.local_stages,
            plan=self.plan,
            spec=spec,
            n_microbatches=self._n_microbatches,
            ranks=stage_ranks(self.plan.n_stages, self.pp_size, spec.placement),
            rank=self.pp_rank,
            group=self.device_mesh["pipeline_parallel"].get_group(),
            device=self.root_device,
        )
        self._patch_clipping()

    def _build_stages(self, module: pl.LightningModule) -> None:
        settings = self.settings
        block_list = settings.block_list or getattr(module, "pipeline_blocks", None)
        if not block_list:
            raise ConfigError(
                f"`block_list=None` and {type(module).__name__} declares no `pipeline_blocks`; set `block_list` to "
                "the attribute name of its `nn.ModuleList` of blocks.",
                setting="block_list",
            )
        blocks = getattr(module, block_list, None)
        if not isinstance(blocks, nn.ModuleList):
            raise ConfigError(
                f"`block_list={block_list!r}`: {type(module).__name__} has no `nn.ModuleList` of that name; name the "
                "list of blocks to split.",
                setting="block_list",
            )
        spec = settings.spec
        n_stages = settings.n_stages or (None if settings.split_points else self.pp_size * spec.stages_per_rank)
        plan = plan_pipeline_stages(
            len(blocks), block_list=block_list, split_points=settings.split_points, n_stages=n_stages
        )
        ranks = stage_ranks(plan.n_stages, self.pp_size, spec.placement)  # checked by settings.validate(world=...)
        self._n_microbatches = microbatches_for(settings.n_microbatches, plan.n_stages)
        check_microbatches(spec.name, self._n_microbatches, plan.n_stages, self.pp_size)
        self.local_stages = [s for s, r in enumerate(ranks) if r == self.pp_rank]
        self._views = prune_to_stages(module, plan, self.local_stages)
        self.plan = plan
        if settings.data_parallel == "fsdp" and self.device_mesh["data_parallel"].size() > 1:
            shard_stages(plan, self.local_stages, self._views, self.device_mesh["data_parallel"])

    # -- the Lightning loop -----------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = args[0] if args else kwargs["batch"]
        assert self._runner is not None and self.lightning_module is not None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        with self.precision_plugin.train_step_context():
            self._step_result = self._runner.step(batch, train=True, accumulate=accumulate)
        self._log_loss("train", self._step_result.loss)
        return self._step_result.loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        """The schedule already ran backward in `training_step`: add its gradients (averaged over replicas)."""
        module = self.lightning_module
        assert module is not None
        result, self._step_result = self._step_result, None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        dp = self.device_mesh["data_parallel"]
        replicate = dp.size() > 1 and self.settings.data_parallel == "replicate"
        for param, grad in result.grads if result is not None else ():
            if replicate:
                dist.all_reduce(grad, group=dp.get_group())
                grad.div_(dp.size())
            param.grad = grad if param.grad is None else param.grad + grad
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", args[0] if args else kwargs["batch"])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", args[0] if args else kwargs["batch"])

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "PipelineStrategy does not run `trainer.predict`; consolidate the checkpoint "
            "(lightning_accel.strategies.consolidate_checkpoint) and predict with the plain model."
        )

    def _eval_step(self, stage: str, batch: Any) -> torch.Tensor:
        assert self._runner is not None
        context = self.precision_plugin.val_step_context if stage == "val" else self.precision_plugin.test_step_context
        with context():
            loss = self._runner.step(batch, train=False).loss
        self._log_loss(stage, loss)
        return loss

    def _log_loss(self, stage: str, loss: torch.Tensor) -> None:
        module = self.lightning_module
        assert module is not None
        hook = getattr(module, "log_loss", None)
        if callable(hook):
            hook(stage, loss)
        elif stage == "train":
            module.log("train/loss", loss, on_step=True, prog_bar=True)
        else:
            module.log(f"{stage}/loss", loss, on_epoch=True, sync_dist=True, prog_bar=stage == "val")

    # -- gradient clipping over all stages, and its undo -----------------------------------------------------------

    def _patch_clipping(self) -> None:
        """Clip by the norm over every stage: the precision plugin's `clip_grad_by_norm`, replaced on this instance
        until `teardown` or `on_exception`."""
        self._patches.close()  # a second setup without a teardown in between patches once
        clip = functools.partial(
            clip_grad_norm_over_stages, group=self.device_mesh["pipeline_parallel"].get_group(), device=self.root_device
        )
        undo = patch_attribute(
            self.precision_plugin, "clip_grad_by_norm", clip, why="PipelineStrategy's gradient clipping over all stages"
        )
        self._patches.callback(undo)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._patches.close()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._patches.close()
        self._runner = None  # and the schedules it built
        self._step_result = None
        super().teardown()

    # -- checkpoints ---------------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, flattened, so stages' entries do not collide."""
        assert self.model is not None
        return optimizer_state_dict(self.model, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("`PipelineStrategy.save_checkpoint(..., storage_options=...)` is not supported.")
        save_pipeline_checkpoint(self, checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None
        return load_pipeline_checkpoint(self, self.model, checkpoint_path, weights_only)


def _check_module(module: pl.LightningModule) -> None:
    """What the strategy needs of the LightningModule."""
    if not module.automatic_optimization:
        raise ConfigError(
            f"{type(module).__name__} sets `automatic_optimization=False`, which PipelineStrategy does not "
            "support: the pipeline schedule runs forward and backward itself; use automatic optimization."
        )
    if not callable(getattr(module, "pipeline_loss", None)):
        raise ConfigError(
            f"{type(module).__name__} has no `pipeline_loss(output, target)` method, which PipelineStrategy "
            "calls on the last stage for each micro-batch; add one returning the micro-batch's mean loss."
        )
