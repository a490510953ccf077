"""lightning_accel.parallel on one process: block and plan matching, checkpointing, compile, a 1-rank mesh."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_accel import examples
from lightning_accel.errors import ConfigError
from lightning_accel.parallel import (
    BlockWrapPolicy,
    apply_tensor_parallel,
    block_wrap_policy,
    checkpoint_blocks,
    compile_blocks,
    find_blocks,
    is_parallelized,
    mixed_precision_policy,
    parallelize,
    resolve_tp_plan,
)
from lightning_accel.strategies import ModelParallelStrategy

Block = examples.Block
GPTLanguageModel = examples.GPTLanguageModel

TINY = {"block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}
GPT_PLAN = {
    "blocks.*.attn.q_proj": "colwise",
    "blocks.*.attn.k_proj": "colwise",
    "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.out_proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
}


def _model() -> GPTLanguageModel:
    torch.manual_seed(0)
    return GPTLanguageModel(**TINY)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(model: GPTLanguageModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model._loss(_batch())
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return loss.detach(), grads


def test_blocks_found_by_name_qualified_name_or_class() -> None:
    model = _model()
    expected = ["blocks.0", "blocks.1"]
    for spec in (["Block"], ["lightning_accel.examples.gpt.Block"], [Block], ["Block", "MLP"]):
        assert [name for name, _ in find_blocks(model, spec)] == expected  # MLP inside Block: the outer one only
    assert [name for name, _ in find_blocks(model, ["MLP"])] == ["blocks.0.mlp", "blocks.1.mlp"]
    with pytest.raises(ConfigError, match="'GPTLanguageModel' matches no submodule"):
        find_blocks(model, ["GPTLanguageModel"])  # the root is never a block


def test_unknown_block_class_names_the_classes_there_are() -> None:
    message = r"`block_classes` entry 'TransformerBlock' matches no submodule of GPTLanguageModel; its submodule "
    with pytest.raises(ConfigError, match=message + r"classes are \[.*'Block'.*'MLP'"):
        find_blocks(_model(), ["Block", "TransformerBlock"])


def test_gpt_plan_resolves_to_the_six_projections_of_each_block() -> None:
    resolved = resolve_tp_plan(_model(), GPT_PLAN)
    assert len(resolved) == 12
    assert isinstance(resolved["blocks.1.attn.q_proj"], ColwiseParallel)
    assert isinstance(resolved["blocks.0.mlp.proj"], RowwiseParallel)
    assert isinstance(resolve_tp_plan(_model(), {"*.ln_1": "sequence"})["blocks.0.ln_1"], SequenceParallel)
    style = RowwiseParallel(use_local_output=False)
    assert resolve_tp_plan(_model(), {"*.attn.out_proj": style})["blocks.0.attn.out_proj"] is style


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"*.attn.query": "colwise"}, r"pattern '\*.attn.query' matches no submodule of GPTLanguageModel"),
        ({"*.q_prj": "colwise"}, r"matches no submodule .* named like \["),
        ({"*.q_proj": "colwise", "blocks.0.attn.*_proj": "rowwise"}, r"both match 'blocks.0.attn.q_proj'"),
        ({"*.ln_1": "colwise"}, r"matches 'blocks.0.ln_1', a LayerNorm; 'colwise' shards nn.Linear and nn.Embedding"),
        ({"*.q_proj": "columnwise"}, r"`tp_plan\['\*.q_proj'\]='columnwise'` is not a tensor-parallel style"),
        ({"*.q_proj": 3}, r"neither a style name"),
    ],
)
def test_bad_plans_name_the_pattern(plan: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_tp_plan(_model(), plan)


def test_activation_checkpointing_keeps_outputs_grads_and_names() -> None:
    plain, checkpointed = _model(), _model()
    assert checkpoint_blocks(checkpointed, ["Block"]) == ["blocks.0", "blocks.1"]
    assert checkpoint_blocks(checkpointed, ["Block"]) == []  # once
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    calls = []
    checkpointed = pickle.loads(pickle.dumps(checkpointed))  # still picklable, and checkpointed after
    checkpointed.blocks[0].mlp.fc.register_forward_hook(lambda *_: calls.append(1))
    loss, grads = _loss_and_grads(plain)
    loss_ac, grads_ac = _loss_and_grads(checkpointed)
    assert len(calls) == 2  # forward, and again in backward: the activations were recomputed
    torch.testing.assert_close(loss_ac, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-6, atol=1e-7)


def test_compile_blocks_in_place_keeps_outputs_and_names() -> None:
    plain, compiled = _model(), _model()
    checkpoint_blocks(compiled, ["Block"])
    assert compile_blocks(compiled, ["Block"], backend="aot_eager") == ["blocks.0", "blocks.1"]
    assert compile_blocks(compiled, ["Block"], backend="aot_eager") == []
    assert list(compiled.state_dict()) == list(plain.state_dict())  # no `_orig_mod.`
    copied = copy.deepcopy(compiled)  # picklable, unlike torch.compile's own wrapper
    for model in (compiled, copied):
        loss, grads = _loss_and_grads(plain)
        loss_c, grads_c = _loss_and_grads(model)
        torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6)
        plain.zero_grad()


def test_checkpointing_or_compile_need_block_classes() -> None:
    with pytest.raises(ConfigError, match="name the block class in `block_classes`"):
        parallelize(_model(), activation_checkpointing=True)


def test_mixed_precision_policy_from_names() -> None:
    policy = mixed_precision_policy("bfloat16", "float32")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy().param_dtype is None
    with pytest.raises(ConfigError, match="`param_dtype='bf16'` is not a floating-point torch dtype"):
        mixed_precision_policy("bf16")


def test_fsdp1_wrap_policy_picks_blocks_by_name() -> None:
    assert block_wrap_policy(None) is None and block_wrap_policy([]) is None
    policy = block_wrap_policy(["Block"])
    assert isinstance(policy, BlockWrapPolicy)
    model = _model()
    assert policy(model.blocks[0], recurse=False) and not policy(model.lm_head, recurse=False)
    assert policy(model, recurse=True)  # keep descending


def test_strategy_data_parallel_size_fills_the_world() -> None:
    def resolved(devices: int, **sizes: object) -> object:
        strategy = ModelParallelStrategy(**sizes)
        strategy.parallel_devices = [torch.device("cpu")] * devices
        return strategy._resolved_data_parallel_size()

    assert resolved(4) == 4
    assert resolved(4, tensor_parallel_size=2) == 2
    assert resolved(4, data_parallel_size=1, tensor_parallel_size=4) == 1
    assert resolved(4, tensor_parallel_size="auto") == "auto"  # Lightning's meaning: nodes x devices per node
    with pytest.raises(ConfigError, match="`tensor_parallel_size=3` does not divide the world size 4"):
        resolved(4, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="`data_parallel_size=0` must be a positive integer"):
        ModelParallelStrategy(data_parallel_size=0)


def test_tensor_parallel_on_a_one_rank_mesh_keeps_outputs_and_grads(one_rank_mesh) -> None:
    plain, sharded = _model(), _model()
    applied = apply_tensor_parallel(sharded, one_rank_mesh["tensor_parallel"], GPT_PLAN)
    assert len(applied) == 12 and is_parallelized(sharded) and not is_parallelized(plain)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())  # the rest replicated: one kind of parameter
    assert list(sharded.state_dict()) == list(plain.state_dict())
    loss, grads = _loss_and_grads(plain)
    loss_tp, grads_tp = _loss_and_grads(sharded)
    torch.testing.assert_close(loss_tp, loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_tp[name], grad, rtol=1e-5, atol=1e-6)
    torch.nn.utils.clip_grad_norm_(sharded.parameters(), 0.1)  # no mix of DTensor and plain tensors


def test_tied_parameters_stay_tied_when_replicated(one_rank_mesh) -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False))
    model[2].weight = model[0].weight
    apply_tensor_parallel(model, one_rank_mesh["tensor_parallel"], {"1": "colwise"})
    assert model[2].weight is model[0].weight and isinstance(model[0].weight, DTensor)


def test_parallelize_skips_what_one_rank_does_not_need(one_rank_mesh) -> None:
    model = _model()
    meshes = {"dp_mesh": one_rank_mesh["data_parallel"], "tp_mesh": one_rank_mesh["tensor_parallel"]}
    applied = parallelize(model, block_classes=["Block"], tp_plan=GPT_PLAN, activation_checkpointing=True, **meshes)
    assert (applied.fsdp, applied.tensor_parallel, applied.checkpointed) == (False, {}, ["blocks.0", "blocks.1"])
    assert applied.describe() == "tp=0 modules, ac=2 blocks, compile=0 blocks, fsdp=off"
    assert not is_parallelized(model)


def test_empty_plan_on_a_tensor_parallel_mesh_is_an_error() -> None:
    class TwoRanks:
        def size(self) -> int:
            return 2

    with pytest.raises(ConfigError, match="tensor-parallel mesh has 2 ranks but `tp_plan` is empty"):
        parallelize(_model(), block_classes=["Block"], tp_mesh=TwoRanks())  # type: ignore[arg-type]


def test_is_parallelized_sees_fsdp_units(one_rank_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(_model())
    fully_shard(model.blocks[0], mesh=one_rank_mesh["data_parallel"])
    assert is_parallelized(model)


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_fsdp1_wraps_the_blocks_the_policy_names(one_rank_mesh) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(
        _model(), auto_wrap_policy=BlockWrapPolicy(["Block"]), device_id=torch.device("cpu")
    )
    units = [name for name, sub in wrapped.named_modules() if isinstance(sub, FullyShardedDataParallel)]
    assert units == ["", "_fsdp_wrapped_module.blocks.0", "_fsdp_wrapped_module.blocks.1"]


def test_model_parallel_errors_name_the_constructor_argument() -> None:
    with pytest.raises(ConfigError, match=r"^`tensor_parallel_size=0` must be") as caught:
        ModelParallelStrategy(tensor_parallel_size=0)
    assert "trainer.strategy" not in str(caught.value)
    assert str(caught.value.at("trainer.strategy")).startswith("`trainer.strategy.tensor_parallel_size=0`")
