"""A checkpoint read a module at a time: safetensors opened lazily, one decoder layer built and filled on demand.

The footing for layer streaming: a model larger than memory is worked on layer by layer, each layer's weights
read from its shard when it is needed and freed after, the rest of the model never loaded.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from attnsurg.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def reads_lazily(path: Path) -> bool:
    """Whether a checkpoint directory's weights are safetensors a ``CheckpointReader`` reads a tensor at a time."""
    return (Path(path) / INDEX_FILE).is_file() or (Path(path) / SINGLE_FILE).is_file()


class CheckpointReader:
    """The tensors of a safetensors checkpoint directory (one file, or shards with an index), by name; each read
    maps only that tensor from its file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        if (self.path / INDEX_FILE).is_file():
            return json.loads((self.path / INDEX_FILE).read_text())["weight_map"]
        if (self.path / SINGLE_FILE).is_file():
            with safe_open(str(self.path / SINGLE_FILE), framework="pt") as f:
                return {name: SINGLE_FILE for name in f.keys()}
        raise UserError(f"'{self.path}' has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}) to read lazily")

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.weight_map:
            raise UserError(f"'{self.path}' has no tensor '{name}'")
        with safe_open(str(self.path / self.weight_map[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        require_finite(name, tensor, str(self.path))
        return tensor if dtype is None else tensor.to(dtype)

    def state(self, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every tensor under ``prefix`` (``model.layers.3.``), keyed without it, read file by file."""
        names = [name for name in self.weight_map if name.startswith(prefix)]
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.weight_map[name], []).append(name)
        state = {}
        for filename, in_file in by_file.items():
            with safe_open(str(self.path / filename), framework="pt") as f:
                for name in in_file:
                    tensor = f.get_tensor(name)
                    require_finite(name, tensor, str(self.path))
                    state[name.removeprefix(prefix)] = tensor if dtype is None else tensor.to(dtype)
        return state


FINITE_CHUNK = 1 << 24  # values checked at a time: a 70B model's embedding table would need a 1 GB mask at once


def require_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """NaN or infinity in a stored weight is a corrupt checkpoint: named before any work reads it."""
    if tensor.is_floating_point() and not all(bool(torch.isfinite(part).all()) for part in tensor.reshape(-1).split(FINITE_CHUNK)):
        raise UserError(f"'{where}' has NaN or infinite values in {name}: the checkpoint is corrupt; "
                        "fetch or export it again")


def decoder_layer_class(config: PretrainedConfig) -> type[nn.Module]:
    """The family's decoder layer class (``LlamaDecoderLayer``), as transformers' causal LM names it."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    name = model_class._no_split_modules[0]
    return getattr(sys.modules[model_class.__module__], name)


def load_layer(reader: CheckpointReader, config: PretrainedConfig, index: int, dtype: torch.dtype = torch.float32,
               prefix: str = "model.layers") -> nn.Module:
    """Decoder layer ``index``, built empty (meta device) and filled from the checkpoint in ``dtype``: what the
    full model's ``model.layers[index]`` is, without loading the full model."""
    with torch.device("meta"):
        layer = decoder_layer_class(config)(config, index)
    state = reader.state(f"{prefix}.{index}.", dtype)
    missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise UserError(f"layer {index} of '{reader.path}' does not match its config: missing {missing}, "
                        f"unexpected {unexpected}")
    return layer.eval()


def rotary_embedding(config: PretrainedConfig) -> nn.Module:
    """The family's rotary embedding module for this config, built on the CPU (it holds no weights)."""
    with torch.device("meta"):
        skeleton = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    return type(skeleton.model.rotary_emb)(config)


def embedding_scale(config: PretrainedConfig) -> float:
    """What the family's embedding layer multiplies each row by: sqrt(hidden_size) for Gemma's scaled
    embeddings (transformers' ``*ScaledWordEmbedding``, built with that scale), 1 elsewhere."""
    with torch.device("meta"):
        skeleton = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    return config.hidden_size**0.5 if hasattr(skeleton.get_input_embeddings(), "embed_scale") else 1.0


OFFLOADED = "attnsurg_offloaded"  # the attribute naming an offloaded model's execution device


def offloaded_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules an offloaded model reads from its checkpoint at each forward: every decoder layer, the input
    embeddings and the output head (each whole: a layer's forward may use its children's weights directly)."""
    inner = getattr(model, model.base_model_prefix)
    layers = next(module for module in inner.children() if isinstance(module, nn.ModuleList))
    chosen = {id(m) for m in (*layers, model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    return {name: module for name, module in model.named_modules() if id(module) in chosen}


def read_on_forward(module: nn.Module, state: Callable[[], dict[str, torch.Tensor]]) -> None:
    """``module``'s tensors read (``state()``) just before each forward and dropped to the meta device after it."""
    empty = {name: torch.empty_like(t, device="meta") for name, t in module.state_dict().items()}

    def load(*_):
        module.load_state_dict(state(), assign=True)

    def drop(*_):
        module.load_state_dict(empty, assign=True)

    module.register_forward_pre_hook(load)
    module.register_forward_hook(drop)


def offloaded_model(path: Path, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A checkpoint directory as a model that holds one large module at a time in ``dtype``: each decoder layer,
    the embeddings and the output head are read from the safetensors (``offloaded_modules``) on every forward
    and freed after it; the rest (final norm, rotary) stays on ``device``. What a streamed surgery scores with,
    so scoring a model larger than memory needs one layer of it; its logits are the loaded model's."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    device = device or torch.device("cpu")
    reader = CheckpointReader(Path(path))
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed for real
        model = AutoModelForCausalLM.from_config(config)
    offloaded = offloaded_modules(model)
    for name, module in offloaded.items():
        prefix = stored_prefix(reader, model, name)
        read_on_forward(module, lambda prefix=prefix: {k: t.to(device) for k, t in reader.state(prefix, dtype).items()})
    under = tuple(f"{name}." for name in offloaded)
    resident = {name: reader.tensor(name, dtype).to(device) for name in model.state_dict() if not name.startswith(under)}
    model.load_state_dict(resident, strict=False, assign=True)
    setattr(model, OFFLOADED, device)
    return model.eval()


IN_MEMORY_SHARE = 0.25  # a checkpoint is scored loaded whole when in float32 it takes at most this share of free memory


def scoring_model(path: Path, device: torch.device | None = None) -> nn.Module:
    """A checkpoint directory as a model to score: loaded whole in float32 when it fits easily in the free
    memory of the CPU it is scored on (each forward then reads nothing from disk), else ``offloaded_model``, one
    large module at a time. The logits are the same either way."""
    import psutil
    from transformers import AutoModelForCausalLM

    device = device or torch.device("cpu")
    if device.type == "cpu" and float32_bytes(CheckpointReader(Path(path))) <= IN_MEMORY_SHARE * psutil.virtual_memory().available:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return offloaded_model(path, device)


def float32_bytes(reader: CheckpointReader) -> int:
    """What the checkpoint's tensors take in float32, from the safetensors headers alone."""
    total = 0
    for filename in sorted(set(reader.weight_map.values())):
        with safe_open(str(reader.path / filename), framework="pt") as f:
            total += sum(4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def stored_prefix(reader: CheckpointReader, model: nn.Module, module: str) -> str:
    """Where module ``module``'s tensors are stored: under its own name, or for an output head tied to the
    input embeddings (and so not stored), under the embeddings' name."""
    prefix = f"{module}."
    head = model.get_output_embeddings()
    if head is not None and model.get_submodule(module) is head and not any(n.startswith(prefix) for n in reader.weight_map):
        embeddings = model.get_input_embeddings()
        return next(f"{name}." for name, m in model.named_modules() if m is embeddings)
    return prefix


def execution_device(model: nn.Module) -> torch.device:
    """Where a model's forward runs: its parameters' device, or an offloaded one's (``offloaded_model``)."""
    return getattr(model, OFFLOADED, None) or next(model.parameters()).device
