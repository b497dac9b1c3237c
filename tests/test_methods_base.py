import pytest
import torch

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.methods.base import COMPRESSORS, compressor_for, method_of
from attnsurg.methods.consumers import LayerContext, layer_contexts
from attnsurg.recipe import COMPRESS_METHODS, HeadTensorSettings, LokiSettings, LowRankSettings

from conftest import build_tiny

SETTINGS = [
    LowRankSettings(method="svd", ratio=0.5),
    LowRankSettings(method="asvd", ratio=0.5),
    LowRankSettings(method="svdllm", ratio=0.5, kv_latent=True, targets=("k", "v")),
    HeadTensorSettings(method="tucker", ratio=0.5),
    HeadTensorSettings(method="cp", ranks=(4,)),
    HeadTensorSettings(method="tucker", ratio=0.5, stacked=True),
    LokiSettings(rank=8, top_k=16),
]


def test_every_compress_method_has_exactly_one_implementation():
    names = {name for method in COMPRESSORS for name in method.names}
    assert names == set(COMPRESS_METHODS)
    for settings in SETTINGS:
        assert sum(method.handles(settings) for method in COMPRESSORS) == 1, settings
    assert len({method.plan_type for method in COMPRESSORS}) == len(COMPRESSORS)


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
def test_a_layer_operated_alone_writes_what_the_whole_model_operation_holds(settings, tiny):
    """``operate_layer`` (the streamed path) and ``operate`` (the loaded one) are one operation: every tensor the
    layer writes is the operated model's, and the plan finds its method again."""
    model, family, layer_stats = tiny
    method = compressor_for(settings)
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
