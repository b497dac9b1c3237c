import pytest
import torch

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.methods.base import SURGERY_METHODS, compress_method_names, method_for, method_of, settings_for_method
from attnsurg.methods.consumers import LayerContext, layer_contexts
from attnsurg.methods.headtensor import HeadTensorSettings
from attnsurg.methods.loki import LokiSettings
from attnsurg.methods.lowrank import LowRankSettings
from attnsurg.methods.topk import TopKSettings
from attnsurg.recipe import CompressStep, MLASettings

from conftest import build_tiny

SETTINGS = [
    LowRankSettings(method="svd", ratio=0.5),
    LowRankSettings(method="asvd", ratio=0.5),
    LowRankSettings(method="svdllm", ratio=0.5, kv_latent=True, targets=("k", "v")),
    HeadTensorSettings(method="tucker", ratio=0.5),
    HeadTensorSettings(method="cp", ranks=(4,)),
    HeadTensorSettings(method="tucker", ratio=0.5, stacked=True),
    LokiSettings(rank=8, top_k=16),
    TopKSettings(top_k=0.5),
]


def test_every_compress_method_has_exactly_one_implementation():
    assert {settings.method for settings in SETTINGS} == set(compress_method_names())
    for settings in SETTINGS:
        assert sum(method.handles(settings) for method in SURGERY_METHODS) == 1, settings
    assert len({method.plan_type for method in SURGERY_METHODS}) == len(SURGERY_METHODS)
    assert [method.step for method in SURGERY_METHODS if method.handles(MLASettings(kv_budget=0.5))] == ["convert"]


@pytest.fixture(scope="module")
def tiny():
    model = build_tiny("llama", 384, num_key_value_heads=2)
    family = family_for_surgery("llama")
    windows = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    attentions = attention_layers(model, family)
    stats = input_statistics(model, attentions + [a.o_proj for a in attentions], windows)
    layer_stats = list(zip(stats[: len(attentions)], stats[len(attentions):], strict=True))
    return model, family, layer_stats


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.method}{'-stacked' if getattr(s, 'stacked', False) else ''}")
@torch.no_grad()
def test_a_layer_operated_alone_writes_what_the_whole_model_operation_holds(settings, tiny):
    """``operate`` (the loaded path) assembles what ``operate_layer`` (the streamed path's step) writes: every
    tensor a layer writes is in the operated model unchanged, and the plan finds its method again."""
    model, family, layer_stats = tiny
    method = method_for(settings)
    anatomy = inspect_config(model.config)
    operated = method.operate(model, family, layer_stats, method.plan(anatomy, settings), 32, seed=0)
    assert method_of(operated.plan) is method
    state = operated.model.state_dict()
    contexts = layer_contexts(model, family, layer_stats, 32)
    for index, context in enumerate(contexts):
        assert isinstance(context, LayerContext)
        tensors = method.operate_layer(method.plan(anatomy, settings), family, index, context, seed=0)
        written = {f"{path}.{name}": t for path, module in tensors.replaced.items() for name, t in module.items()}
        written.update(tensors.added)
        assert written, "a layer's operation wrote nothing"
        for name, tensor in written.items():
            assert torch.allclose(tensor.to(state[name].dtype), state[name], atol=1e-6), name


@pytest.mark.parametrize("name", compress_method_names())
def test_a_compress_step_is_read_by_the_settings_its_method_registered(name):
    settings = settings_for_method(name)
    step = CompressStep.model_validate({"compress": {"method": name}})
    assert type(step.compress) is settings and step.compress.method == name
    assert CompressStep.model_validate(step.model_dump(mode="json")) == step


def test_each_planned_method_is_registered_by_its_own_module_once():
    from attnsurg.methods.planning import PLANNED, register_planned

    owners = {name: method.proxy.__module__ for name, method in PLANNED.items()}
    assert owners["svdllm-allocate"] == "attnsurg.methods.lowrank" and owners["cp"] == "attnsurg.methods.headtensor"
    assert owners["loki-variance"] == "attnsurg.methods.loki" and owners["mla"] == "attnsurg.methods.mla.proxy"
    assert owners["linear"] == "attnsurg.methods.linear.proxy"
    with pytest.raises(ValueError, match="registered twice"):
        register_planned(PLANNED["mla"])
