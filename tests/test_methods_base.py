import pytest
import torch

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.methods.base import compress_method_names, method_for, method_of, settings_for_method, surgery_methods
from attnsurg.methods.consumers import LayerContext, layer_contexts
from attnsurg.methods.headtensor import HeadTensorSettings
from attnsurg.methods.loki import LokiSettings
from attnsurg.methods.lowrank import LowRankSettings
from attnsurg.methods.topk import TopKSettings
from attnsurg.recipe import CompressStep
from attnsurg.methods.mla.settings import MLASettings

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
        assert sum(method.handles(settings) for method in surgery_methods()) == 1, settings
    assert len({method.plan_type for method in surgery_methods()}) == len(surgery_methods())
    assert [method.step for method in surgery_methods() if method.handles(MLASettings(kv_budget=0.5))] == ["convert"]


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
    from attnsurg.methods.planning import planned_methods, register_planned

    PLANNED = planned_methods()
    owners = {name: method.proxy.__module__ for name, method in PLANNED.items()}
    assert owners["svdllm-allocate"] == "attnsurg.methods.lowrank" and owners["cp"] == "attnsurg.methods.headtensor"
    assert owners["loki-variance"] == "attnsurg.methods.loki" and owners["mla"] == "attnsurg.methods.mla.proxy"
    assert owners["linear"] == "attnsurg.methods.linear.proxy"
    with pytest.raises(ValueError, match="registered twice"):
        register_planned(PLANNED["mla"])


@pytest.mark.parametrize("start, heavy_libraries", [
    ("import attnsurg.cli", ("torch", "transformers")),
    # a command's run quiets transformers' logging first (``cli.common.quiet_libraries``): its light part only
    ("from attnsurg.cli import main; sys.argv = ['attnsurg', 'compress', '--help']\ntry: main()\nexcept SystemExit: pass",
     ("torch", "transformers.models", "transformers.modeling_utils")),
])
def test_the_command_line_starts_without_torch_or_any_method(start, heavy_libraries):
    """``attnsurg --help`` (every command module imported) and ``compress --help`` (listing every method) load
    neither torch nor a model nor a method module: methods register on the first question to the registry, and
    their names come from the catalog."""
    import subprocess
    import sys

    probe = (f"import sys\n{start}\n"
             "light = lambda m: getattr(sys.modules[m], '__file__', '').endswith(('__init__.py', 'settings.py')); "
             f"heavy = sorted(m for m in sys.modules if m.startswith({heavy_libraries!r}) "
             "or (m.startswith('attnsurg.methods') and not light(m) and m != 'attnsurg.methods.catalog')); "
             "print(heavy, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr


def test_the_catalog_names_what_the_modules_register():
    from attnsurg.methods import catalog, registered_methods
    from attnsurg.methods.base import surgery_methods

    registered = {catalog.Entry(name, method.step, type(method).__module__.split(".")[2])
                  for method in surgery_methods() for name in method.names}
    assert registered == set(catalog.CATALOG)
    assert list(registered_methods()) == list(dict.fromkeys(entry.name for entry in catalog.CATALOG))


def test_every_listing_of_methods_is_in_one_order_whatever_was_imported_first():
    import subprocess
    import sys

    listing = ("from attnsurg.methods import registered_methods; from attnsurg.methods.planning import planned_methods; "
               "from attnsurg.methods.base import surgery_methods; print(list(registered_methods()), list(planned_methods()), "
               "[type(m).__name__ for m in surgery_methods()])")
    runs = [subprocess.run([sys.executable, "-c", first + listing], capture_output=True, text=True, check=True).stdout
            for first in ("", "import attnsurg.methods.topk; import attnsurg.methods.mla; ")]
    assert runs[0] == runs[1] and runs[0].startswith("['svd', 'asvd', 'svdllm', 'tucker', 'cp', 'linear', 'loki', 'mla'")
