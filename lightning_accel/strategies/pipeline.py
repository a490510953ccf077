"""PipelineStrategy: pipeline parallelism (torch.distributed.pipelining) inside the Lightning Trainer's own loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.precision import PIPELINE_PRECISIONS  # one home for precision names
from lightning_accel.strategies.checkpoint_io import (
    recover_directory,
    remove_stale_staging,
    replace_directory,
    staging_path,
)
from lightning_accel.strategies.pipeline_stages import (
    StagePlan,
    check_dcp_metadata,
    check_microbatches,
    check_torch_pipelining,
    load_metadata,
    microbatches_for,
    plan_stages,
    prune_to_stages,
    schedule_class,
    stage_ranks,
)

__all__ = ["PIPELINE_PRECISIONS", "PipelineStrategy"]


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

    Raises:
        ConfigError: for an unknown or missing schedule, a non-positive size, a split point that does not exist, more
            stages than blocks, manual optimization, an unsupported precision, or a batch that does not divide into
            micro-batches (the last three when the Trainer starts).

    Example::

        trainer = Trainer(devices=2, strategy=PipelineStrategy(schedule="1f1b", n_microbatches=4))
        trainer.fit(GPTLanguageModel(n_layer=4), datamodule)
    """

    def __init__(
        self,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        split_points: Sequence[str] | None = None,
        n_stages: int | None = None,
        data_parallel_size: int = 1,
        data_parallel: Literal["replicate", "fsdp"] = "replicate",
        block_list: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_torch_pipelining()
        schedule_class(schedule)  # an unknown name or one this torch lacks fails here
        for name, value in (("n_microbatches", n_microbatches), ("n_stages", n_stages),
                            ("data_parallel_size", data_parallel_size)):  # fmt: skip
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"`trainer.strategy.{name}={value!r}` must be a positive integer.")
        if data_parallel not in ("replicate", "fsdp"):
            raise ConfigError(f"`trainer.strategy.data_parallel={data_parallel!r}` must be 'replicate' or 'fsdp'.")
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timeout)  # fmt: skip
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.split_points = list(split_points) if split_points else None
        self.n_stages = n_stages
        self.data_parallel = data_parallel
        self.block_list = block_list
        self.plan: StagePlan | None = None
        self.local_stages: list[int] = []
        self._stage_modules: list[nn.Module] = []
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._micro_losses: list[torch.Tensor] = []
        self._pending_grads: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._restore_clip: Callable[[], None] | None = None

    # -- the mesh ------------------------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self._setup_distributed()
        world, dp = self.world_size, int(self._data_parallel_size)
        if world % dp:
            raise ConfigError(
                f"`trainer.strategy.data_parallel_size={dp}` does not divide the world size {world}; use a divisor "
                f"of {world}."
            )
        self._device_mesh = init_device_mesh(
            self.root_device.type, (world // dp, dp), mesh_dim_names=("pipeline_parallel", "data_parallel")
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

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
        self._check_trainer(trainer, module)
        if self.plan is None:  # a second setup (test after fit) keeps the stages it built
            self._build_stages(module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._install_global_clipping()

    def _check_trainer(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not module.automatic_optimization:
            raise ConfigError(
                f"{type(module).__name__} sets `automatic_optimization=False`, which `strategy=pipeline` does not "
                "support: the pipeline schedule runs forward and backward itself; use automatic optimization."
            )
        precision = str(trainer.precision)
        if precision not in PIPELINE_PRECISIONS:
            raise ConfigError(
                f"`trainer.precision={precision}` is not supported by `strategy=pipeline` (it takes "
                f"{', '.join(PIPELINE_PRECISIONS[:4])}); use `precision=bf16_mixed` or `precision=fp32`."
            )
        if not callable(getattr(module, "pipeline_loss", None)):
            raise ConfigError(
                f"{type(module).__name__} has no `pipeline_loss(output, target)` method, which `strategy=pipeline` "
                "calls on the last stage for each micro-batch; add one returning the micro-batch's mean loss."
            )

    def _build_stages(self, module: pl.LightningModule) -> None:
        block_list = self.block_list or getattr(module, "pipeline_blocks", None)
        if not block_list:
            raise ConfigError(
                f"`trainer.strategy.block_list=null` and {type(module).__name__} declares no `pipeline_blocks`; set "
                "`trainer.strategy.block_list` to the attribute name of its `nn.ModuleList` of blocks."
            )
        blocks = getattr(module, block_list, None)
        if not isinstance(blocks, nn.ModuleList):
            raise ConfigError(
                f"`trainer.strategy.block_list={block_list!r}`: {type(module).__name__} has no `nn.ModuleList` "
                "of that name; name the list of blocks to split."
            )
        _, per_rank, placement = schedule_class(self.schedule)
        n_stages = self.n_stages or (None if self.split_points else self.pp_size * per_rank)
        plan = plan_stages(len(blocks), block_list=block_list, split_points=self.split_points, n_stages=n_stages)
        ranks = stage_ranks(plan.n_stages, self.pp_size, placement)
        if per_rank == 1 and plan.n_stages != self.pp_size:
            raise ConfigError(
                f"`trainer.strategy.schedule={self.schedule}` runs one stage per pipeline rank, but there are "
                f"{plan.n_stages} stages for {self.pp_size} ranks; use `n_stages={self.pp_size}` or an interleaved "
                "schedule (interleaved_1f1b)."
            )
        if per_rank > 1 and plan.n_stages < 2 * self.pp_size:
            raise ConfigError(
                f"`trainer.strategy.schedule={self.schedule}` needs at least 2 stages per pipeline rank "
                f"({2 * self.pp_size}), got {plan.n_stages}; raise `n_stages` or use gpipe/1f1b."
            )
        self.n_microbatches = microbatches_for(self.n_microbatches, plan.n_stages)
        check_microbatches(self.schedule, self.n_microbatches, plan.n_stages, self.pp_size)
        self.local_stages = [s for s, r in enumerate(ranks) if r == self.pp_rank]
        self._stage_modules = prune_to_stages(module, plan, self.local_stages)
        self.plan = plan
        if self.data_parallel == "fsdp" and self.device_mesh["data_parallel"].size() > 1:
            self._shard_stages(plan)

    def _shard_stages(self, plan: StagePlan) -> None:
        """FSDP2 over the data-parallel ranks: each block, then each stage module as the root of what is left.

        `reshard_after_forward=False`: a stage's parameters stay gathered between the forward and the backward of its
        micro-batches, so each is all-gathered once per step rather than once per micro-batch.
        """
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for stage, view in zip(self.local_stages, self._stage_modules, strict=True):
            blocks = getattr(view, plan.block_list)
            for index in plan.blocks[stage]:
                fully_shard(blocks[index], mesh=mesh, reshard_after_forward=False)
            fully_shard(view, mesh=mesh, reshard_after_forward=False)

    def _pipeline(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, train: bool, n_micro: int) -> Any:
        """The schedule (with its stages) for this batch shape; stages infer their buffers' shapes on first use."""
        from torch.distributed.pipelining import PipelineStage

        key = (train, n_micro, *(tuple(t.shape) for t in inputs), tuple(target.shape), *(t.dtype for t in inputs))
        if key in self._schedules:
            return self._schedules[key]
        assert self.plan is not None
        cls, per_rank, _ = schedule_class(self.schedule)
        group = self.device_mesh["pipeline_parallel"].get_group()
        stages = [
            PipelineStage(view, stage, self.plan.n_stages, self.root_device, group=group)
            for stage, view in zip(self.local_stages, self._stage_modules, strict=True)
        ]
        kwargs: dict[str, Any] = {"n_microbatches": n_micro, "loss_fn": self._loss_fn}
        kwargs["scale_grads"] = False  # _loss_fn scales each micro-batch's loss itself
        built = cls(stages[0] if per_rank == 1 else stages, **kwargs)
        self._schedules[key] = built
        return built

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        module = self.lightning_module
        assert module is not None and self.n_microbatches is not None
        loss = module.pipeline_loss(output, target)
        self._micro_losses.append(loss.detach())
        accumulate = module.trainer.accumulate_grad_batches if module.training else 1
        return loss / (self.n_microbatches * accumulate)

    def _split_batch(self, batch: Any, train: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, int]:
        """The stage inputs, the target and the number of micro-batches of a batch.

        A training batch must divide into `n_microbatches`; an evaluation batch that does not (the last, smaller batch
        of a validation set) runs as the largest number of equal micro-batches that divides it, so its loss is still
        the batch mean.
        """
        module = self.lightning_module
        hook = getattr(module, "pipeline_inputs", None)
        args, target = hook(batch) if callable(hook) else ((batch[0],), batch[1])
        args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        assert self.n_microbatches is not None
        size = target.shape[0]
        if size % self.n_microbatches == 0:
            return args, target, self.n_microbatches
        if train:
            raise ConfigError(
                f"A training batch of {size} samples does not divide into `trainer.strategy.n_microbatches="
                f"{self.n_microbatches}` micro-batches; make the batch size a multiple of {self.n_microbatches} "
                "(and drop a smaller last batch: DataLoader(drop_last=True)), or change `n_microbatches`."
            )
        return args, target, 1

    def _run(self, batch: Any, train: bool) -> torch.Tensor:
        """One pass of the batch through the pipeline; returns the batch's mean loss on every pipeline rank."""
        inputs, target, n_micro = self._split_batch(batch, train)
        assert self.plan is not None
        first, last = 0 in self.local_stages, self.plan.n_stages - 1 in self.local_stages
        args = inputs if first else ()
        self._micro_losses = []
        for view in self._stage_modules:  # shallow copies of the root: its own `training` flag is not shared
            view.training = self.lightning_module.training
        _, _, placement = schedule_class(self.schedule)
        # Forward only through the stages in order, the batch as one micro-batch: evaluation under torch's V
        # schedules (they cannot run without a backward), and the last, smaller evaluation batch, which need not
        # divide into micro-batches (1F1B would refuse fewer micro-batches than stages).
        in_order = not train and (placement == "v" or n_micro != self.n_microbatches)
        schedule = None if in_order else self._pipeline(inputs, target, train, n_micro)
        if in_order:
            n_micro = 1
            self._forward_in_order(inputs, target, placement)
        elif train:
            schedule.step(*args, target=target if last else None)
        elif hasattr(schedule, "eval"):
            schedule.eval(*args, target=target if last else None)
        else:  # torch without schedule.eval (< 2.9): the same switch eval flips
            schedule._has_backward = False
            try:
                schedule.step(*args, target=target if last else None)
            finally:
                schedule._has_backward = True
        # The stages' shape inference (first use) calls the loss on uninitialized tensors: keep the real ones.
        real = self._micro_losses[-n_micro:]
        loss = torch.stack(real).mean() if last else torch.zeros((), device=self.root_device)
        self._micro_losses = []
        loss = loss.float().detach().clone()
        group = self.device_mesh["pipeline_parallel"].get_group()
        last_rank = stage_ranks(self.plan.n_stages, self.pp_size, placement)[-1]
        dist.broadcast(loss, src=dist.get_global_rank(group, last_rank), group=group)
        return loss

    def _forward_in_order(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, placement: str) -> None:
        """Forward only, the whole batch through stage 0, 1, ... in turn, activations sent between ranks.

        For evaluation under the V-shaped schedules (ZBV, DualPipeV), whose torch implementations need a backward,
        and for an evaluation batch that does not divide into the micro-batches. One micro-batch of the whole batch:
        its loss is the batch mean, as with equal micro-batches.
        """
        assert self.plan is not None
        group = self.device_mesh["pipeline_parallel"].get_group()
        ranks = stage_ranks(self.plan.n_stages, self.pp_size, placement)
        views = dict(zip(self.local_stages, self._stage_modules, strict=True))
        hidden: Any = inputs
        for stage in range(self.plan.n_stages):
            if ranks[stage] != self.pp_rank:
                continue
            if stage > 0 and ranks[stage - 1] != self.pp_rank:
                hidden = (_recv_tensor(dist.get_global_rank(group, ranks[stage - 1]), group, self.root_device),)
            output = views[stage](*hidden)
            if stage == self.plan.n_stages - 1:
                self._micro_losses.append(self.lightning_module.pipeline_loss(output, target).detach())
            elif ranks[stage + 1] != self.pp_rank:
                _send_tensor(output, dist.get_global_rank(group, ranks[stage + 1]), group)
            hidden = (output,)

    # -- the Lightning loop -----------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = args[0] if args else kwargs["batch"]
        params = [p for p in self.model.parameters() if p.requires_grad]  # type: ignore[union-attr]
        earlier = [p.grad for p in params]  # Lightning zeroes gradients between training_step and backward
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._run(batch, train=True)
        self._pending_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, earlier, strict=True):
            p.grad = grad
        self._log_loss("train", loss)
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        """The schedule already ran backward in `training_step`: add its gradients (averaged over replicas)."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        dp = self.device_mesh["data_parallel"]
        replicate = dp.size() > 1 and self.data_parallel == "replicate"
        for param, grad in self._pending_grads:
            if replicate:
                dist.all_reduce(grad, group=dp.get_group())
                grad.div_(dp.size())
            param.grad = grad if param.grad is None else param.grad + grad
        self._pending_grads = []
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
            "`strategy=pipeline` does not run `trainer.predict`; consolidate the checkpoint "
            "(lightning_accel.strategies.consolidate_checkpoint) and predict with the plain model."
        )

    def _eval_step(self, stage: str, batch: Any) -> torch.Tensor:
        context = self.precision_plugin.val_step_context if stage == "val" else self.precision_plugin.test_step_context
        with context():
            loss = self._run(batch, train=False)
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

    # -- gradient clipping over all stages --------------------------------------------------------------------------

    def _install_global_clipping(self) -> None:
        """Clip by the norm over every stage: the precision plugin's clip_grad_by_norm, replaced on this instance."""
        plugin = self.precision_plugin
        if self._restore_clip is not None:
            return
        plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

        def restore() -> None:
            plugin.__dict__.pop("clip_grad_by_norm", None)

        self._restore_clip = restore

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        squares = torch.zeros((), device=self.root_device, dtype=torch.float32)
        sharded: dict[Any, torch.Tensor] = {}  # FSDP2's gradient shards: summed here, then over their mesh's group
        for grad in grads:
            group = _shard_group(grad)
            if group is not None:
                total = sharded.setdefault(group, torch.zeros_like(squares))
                total += grad.to_local().detach().float().pow(2).sum()
            else:
                local = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                squares += local.detach().float().pow(2).sum()
        for group, total in sharded.items():
            dist.all_reduce(total, group=group)
            squares += total
        dist.all_reduce(squares, group=self.device_mesh["pipeline_parallel"].get_group())
        total = squares.sqrt()
        coefficient = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))

    @override
    def teardown(self) -> None:
        if self._restore_clip is not None:
            self._restore_clip()
            self._restore_clip = None
        self._schedules.clear()
        super().teardown()

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=self._options())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, flattened, so stages' entries do not collide."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return get_optimizer_state_dict(self.model, optimizer, options=self._options())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        import torch.distributed.checkpoint as dcp

        if storage_options is not None:
            raise TypeError("`PipelineStrategy.save_checkpoint(..., storage_options=...)` is not supported.")
        path = Path(self.broadcast(filepath))
        # Written beside its target under a temporary name, then renamed over it: a save that dies (SIGKILL, a full
        # disk) leaves the previous checkpoint whole, and no stale shards of an earlier save mix in (last.ckpt).
        staging = Path(self.broadcast(staging_path(path)))
        if self.global_rank == 0:
            recover_directory(path)  # a save killed mid-swap on a file system without an atomic exchange
            remove_stale_staging(path)  # shards of saves that were killed before they completed
            staging.mkdir(parents=True)
        self.barrier()
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(state, checkpoint_id=staging)
        if self.global_rank == 0:
            torch.save(checkpoint, staging / _METADATA_FILENAME)
        self.barrier()  # every rank's shards are complete
        if self.global_rank == 0:
            replace_directory(staging, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if self.global_rank == 0:
            recover_directory(path)
        self.barrier()
        if not path.is_dir():
            raise ConfigError(f"`ckpt_path={str(path)!r}` is not a PipelineStrategy checkpoint directory.")
        meta = load_metadata(path / _METADATA_FILENAME, weights_only)  # before any state is touched
        if weights_only is not False:  # the caller's explicit trust skips the index check too
            check_dcp_metadata(path)
        assert self.model is not None
        state: dict[str, Any] = {"state_dict": self.lightning_module_state_dict()}
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optimizer, options=self._options())
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["state_dict"], options=self._options())
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"], options=self._options())
        return meta


def _shard_group(grad: Any) -> Any:
    """The process group over which a DTensor gradient is sharded (a 1-D mesh, `Shard` placement: FSDP2's); None
    for a plain or replicated tensor, or a layout whose norm needs the full tensor."""
    mesh, placements = getattr(grad, "device_mesh", None), getattr(grad, "placements", ())
    if mesh is None or mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard():
        return None
    return mesh.get_group()


def check_pipeline_config(strategy: Mapping[str, Any], precision: str, world: int | None) -> None:
    """Config-level checks of `strategy=pipeline`, run by `presets.check_combinations` before anything spawns."""
    if precision not in PIPELINE_PRECISIONS:
        raise ConfigError(
            f"`trainer.precision={precision}` is not supported by `strategy=pipeline` (it takes "
            f"{', '.join(PIPELINE_PRECISIONS[:4])}); use `precision=bf16_mixed` or `precision=fp32`."
        )
    name = strategy.get("schedule", "1f1b")
    schedule_class(str(name))
    dp = strategy.get("data_parallel_size", 1)
    if world is not None and isinstance(dp, int) and dp > 0 and world % dp:
        raise ConfigError(
            f"`trainer.strategy.data_parallel_size={dp}` does not divide the world size {world} "
            f"(trainer.devices x trainer.num_nodes); use a divisor of {world}."
        )
    if world is not None and isinstance(dp, int) and dp > 0 and world // dp < 2:
        rank_zero_warn(
            f"`strategy=pipeline` on {world} process(es) with `data_parallel_size={dp}` has a single pipeline rank: "
            "every stage runs on one process; set `trainer.devices` to a multiple of 2 x data_parallel_size.",
            category=LightningAccelWarning,
        )
    points = strategy.get("split_points")
    if points is not None and any(not isinstance(p, str) for p in points):
        raise ConfigError(f"`trainer.strategy.split_points={list(points)}` must be module names such as 'blocks.2'.")
    n_micro = strategy.get("n_microbatches")
    if world is not None and isinstance(dp, int) and dp > 0 and isinstance(n_micro, int):
        pp = max(1, world // dp)
        _, per_rank, _ = schedule_class(str(name))
        n_stages = strategy.get("n_stages") or (len(points) + 1 if points else pp * per_rank)
        if isinstance(n_stages, int):
            check_microbatches(str(name), n_micro, n_stages, pp)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _send_tensor(tensor: torch.Tensor, dst: int, group: Any) -> None:
    """Send a tensor of up to 6 dimensions with a header (rank, shape, dtype) so the receiver can allocate it."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() > 6 or tensor.dtype not in _DTYPES:
        raise TypeError(f"A pipeline stage's output must be one floating tensor of <= 6 dimensions; got {tensor!r}.")
    shape = list(tensor.shape) + [0] * (6 - tensor.dim())
    header = torch.tensor([tensor.dim(), *shape, _DTYPES.index(tensor.dtype)], dtype=torch.int64, device=tensor.device)
    dist.send(header, dst=dst, group=group)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv_tensor(src: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    ndim, *shape, dtype = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor
