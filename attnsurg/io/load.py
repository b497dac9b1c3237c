"""Resolve a MODEL argument and load it: a local checkpoint directory, a GGUF file, a hub id or a
built-in demo name.

Safety rules: pickle (``.bin``) weights are never read unless the caller allows it, and remote code is
never run unless the caller passes ``trust_remote_code``.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from attnsurg import ui
from attnsurg.arch.anatomy import check_sizes, meta_model
from attnsurg.arch.families import supported_names
from attnsurg.errors import UserError
from attnsurg.io.assets import ASSETS, ensure_demo_model
from attnsurg.io.gguf_load import load_gguf
from attnsurg.io.lazy import reads_lazily, require_finite

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

from attnsurg.modeling import MODEL_TYPES as ATTNSURG_MODEL_TYPES
from attnsurg.modeling import register as register_attnsurg_models

register_attnsurg_models()  # attnsurg's own checkpoints load without remote code


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``path`` is a local directory or a hub id."""

    ref: str
    kind: str  # "dir", "gguf", "hub" or "builtin"
    path: str
    gguf_file: str | None = None
    origin: str | None = None  # a staged copy's original (.gguf file, pickle checkpoint, hub id): a resume matches it

    @property
    def files(self) -> Path:
        """What the checkpoint is made of: its directory or its one .gguf file (a staged copy's original)."""
        if self.origin:
            return Path(self.origin)
        return Path(self.path) / self.gguf_file if self.gguf_file else Path(self.path)

    @property
    def is_local(self) -> bool:
        return self.kind != "hub"


def resolve_source(ref: str, allow_pickle: bool = False, trust_remote_code: bool = False) -> ModelSource:
    """Work out what kind of model reference ``ref`` is; user errors for anything unusable."""
    if ref in ASSETS and ASSETS[ref].kind == "model":
        return ModelSource(ref, "builtin", str(ensure_demo_model(ref)))
    path = Path(ref).expanduser()
    if path.is_file():
        return _resolve_file(ref, path)
    if path.is_dir():
        return _resolve_dir(ref, path, allow_pickle, trust_remote_code)
    if ref.startswith((".", "/", "~")) or ref.endswith((".gguf", ".safetensors")) or ref.count("/") > 1:
        raise UserError(f"model path '{ref}' does not exist; check the path")
    if "/" not in ref and (close := difflib.get_close_matches(ref, builtin_models(), n=1, cutoff=0.6)):
        raise UserError(f"'{ref}' is not a local path or a built-in model; did you mean {close[0]}?")
    if HUB_ID.match(ref):
        return ModelSource(ref, "hub", ref)
    raise UserError(
        f"'{ref}' is not a local checkpoint, a hub id (org/name) or a built-in model "
        f"({', '.join(builtin_models())})"
    )


def builtin_models() -> list[str]:
    return [name for name, asset in ASSETS.items() if asset.kind == "model"]


def _resolve_file(ref: str, path: Path) -> ModelSource:
    if path.suffix == ".gguf":
        _check_gguf(path)
        return ModelSource(ref, "gguf", str(path.parent), path.name)
    raise UserError(
        f"'{ref}' is a file, not a checkpoint; pass the directory that holds config.json, or a .gguf file"
    )


def _resolve_dir(ref: str, path: Path, allow_pickle: bool, trust_remote_code: bool) -> ModelSource:
    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ref, "gguf", str(path), ggufs[0].name)
        raise UserError(f"'{ref}' is not a checkpoint directory (no config.json); pass a Hugging Face model directory")
    has_safetensors = any(path.glob("*.safetensors"))
    has_pickle = any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth"))
    if not has_safetensors and has_pickle and not allow_pickle:
        raise UserError(
            f"'{ref}' holds only pickle (.bin) weights, which can run code when loaded; "
            "pass --allow-pickle if you trust this checkpoint"
        )
    if not has_safetensors and not has_pickle:
        raise UserError(f"'{ref}' has a config.json but no weight files (*.safetensors)")
    _check_remote_code(ref, _read_json(config_file), trust_remote_code)
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(weights)
    _check_index(path)
    source = ModelSource(ref, "dir", str(path))
    check_checkpoint_tensors(source, trust_remote_code)
    return source


GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _check_gguf(path: Path) -> None:
    """The GGUF's header and tensor table parse, its tensors lie inside the file, and it holds as many blocks as
    its ``block_count`` says (transformers would fill missing ones with random initial values)."""
    try:
        reader = gguf.GGUFReader(path)
    except (struct.error, ValueError, IndexError, KeyError, OSError, TypeError, OverflowError) as exc:
        raise UserError(f"'{path}' is not a readable GGUF file ({_first_line(exc)}); it may be truncated: copy or "
                        "download it again") from None
    counts = [field for name, field in reader.fields.items() if name.endswith(".block_count")]
    blocks = {int(m.group(1)) for tensor in reader.tensors if (m := GGUF_BLOCK.match(tensor.name))}
    if counts and blocks:
        count = int(counts[0].parts[counts[0].data[0]][0])
        if count != len(blocks):
            raise UserError(f"'{path}' says it has {count} blocks (block_count) but holds {len(blocks)}; copy or "
                            "download it again")


def _check_safetensors(path: Path) -> None:
    """Read the file's header (not its tensors): a truncated or corrupt file is named before any loading."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise UserError(f"'{path}' is not a readable safetensors file ({_first_line(exc)}); it may be truncated: "
                        "copy or download it again")


def _check_index(path: Path) -> None:
    """A safetensors index maps tensor names to shards that are there, each holding the tensors it is said to."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"'{index}' has no weight_map of tensor names to shard files; copy or download the "
                        "checkpoint again")
    shards = sorted(set(weight_map.values()))
    missing = [shard for shard in shards if not (path / shard).is_file()]
    if missing:
        raise UserError(f"'{index}' names {len(missing)} shard(s) that are not there ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''}); copy or download the checkpoint again")
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            held = set(f.keys())
        if absent := sorted(name for name, file in weight_map.items() if file == shard and name not in held):
            raise UserError(f"'{index}' places '{absent[0]}' in {shard}, which does not hold it; copy or download the "
                            "checkpoint again")


LAYER_INDEX = re.compile(r"^(.*)\.layers\.(\d+)\.")


def check_checkpoint_tensors(source: ModelSource, trust_remote_code: bool = False) -> None:
    """The safetensors headers hold every tensor the config's model needs, in the shape it needs, and as many
    layers as the config names (transformers would fill a missing tensor with random initial values, or drop
    extra layers, without a word): the layer count first, from the names alone, so a config claiming thousands
    of layers is refused before any model is built; then each tensor against a meta-device model. Checkpoints
    whose config cannot be built are left to the loader, which says why, pickle weights to its loading report
    (``require_complete``) and quantized checkpoints (packed shapes) to their quantizer."""
    held = header_shapes(Path(source.path))
    if not held:
        return
    try:
        config = load_config(source, trust_remote_code)
    except UserError:
        return
    if getattr(config, "quantization_config", None):
        return
    check_layer_count(source.ref, config.num_hidden_layers, held)
    try:
        model = meta_model(config, trust_remote_code)
    except (ValueError, TypeError, AttributeError, OSError, RuntimeError):
        return
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, (weights, shape) in held.items():
        wanted = expected.get(name)
        if wanted is not None and shape != wanted:
            raise UserError(f"'{weights}' holds '{name}' with shape {list(shape)}, but its config.json needs "
                            f"{list(wanted)}: the weights and the config do not belong together; copy or "
                            "download the checkpoint again")
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    if getattr(config, "tie_word_embeddings", False):
        tied.add("lm_head.weight")  # stored once, as the embeddings
    missing = sorted(name for name in expected if name not in held and name not in tied)
    if missing:
        raise UserError(f"'{source.ref}' lacks {len(missing)} tensor(s) its config.json needs ({', '.join(missing[:2])}"
                        f"{', ...' if len(missing) > 2 else ''}): the checkpoint is incomplete; copy or download it "
                        "again")


def header_shapes(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each tensor the directory's safetensors files hold: its file and shape, read from the headers alone."""
    held: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for weights in sorted(directory.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as f:
            held.update({name: (weights, tuple(f.get_slice(name).get_shape())) for name in f.keys()})
    return held


def check_layer_count(ref: str, layers: int, held: dict) -> None:
    """The decoder layers the tensor names hold against the config's count; left to the tensor check when the
    names hold layers of more than one stack (a vision tower beside the decoder)."""
    stacks: dict[str, set[int]] = {}
    for name in held:
        if m := LAYER_INDEX.match(name):
            stacks.setdefault(m.group(1), set()).add(int(m.group(2)))
    if len(stacks) != 1:
        return
    indices = next(iter(stacks.values()))
    if extra := sorted(indices - set(range(layers))):
        raise UserError(f"'{ref}' holds weights of layer {extra[0]}, but its config.json names {layers} layers; "
                        "fix num_hidden_layers or copy the checkpoint again")
    if len(indices) < layers:
        raise UserError(f"'{ref}' has a config.json naming {layers} layers, but its weights hold {len(indices)}: the "
                        "config names more layers than its weights hold; fix num_hidden_layers or copy the "
                        "checkpoint again")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}")


def _check_remote_code(ref: str, config: dict, trust_remote_code: bool) -> None:
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        raise UserError(f"'{ref}' has a config.json with no model_type string; fix its config.json")
    known = model_type in CONFIG_MAPPING_NAMES or model_type in ATTNSURG_MODEL_TYPES
    if not known and config.get("auto_map") and not trust_remote_code:
        raise UserError(
            f"'{ref}' needs the modeling code shipped with it (model type '{model_type}'); "
            "pass --trust-remote-code if you trust this checkpoint"
        )
    if not known and not config.get("auto_map"):
        raise UserError(f"'{ref}' has unknown model type '{model_type}'; transformers cannot build it")


def load_config(source: ModelSource, trust_remote_code: bool = False) -> PretrainedConfig:
    try:
        if source.kind == "gguf":
            config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
        else:
            config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise UserError(f"cannot load the config of '{source.ref}' ({_first_line(exc)})")
    except ValueError as exc:
        raise UserError(_remote_code_or(exc, source))
    except (StrictDataclassError, ZeroDivisionError) as exc:  # the config class's own checks and derived sizes
        reason = str(exc).strip().splitlines()[-1].strip().removeprefix("ValueError: ") if str(exc).strip() else "division by zero"
        raise UserError(f"the config of '{source.ref}' has impossible values ({reason}); fix its config.json")
    _require_causal_lm(config, source.ref)
    check_sizes(config)
    return config


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _remote_code_or(exc: BaseException, source: ModelSource) -> str:
    if "trust_remote_code" in str(exc):
        return f"'{source.ref}' needs its own modeling code; pass --trust-remote-code if you trust it"
    return f"cannot load '{source.ref}': {_first_line(exc)}"


def _require_causal_lm(config: PretrainedConfig, ref: str) -> None:
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "auto_map", None):
        return
    raise UserError(
        f"'{ref}' is a '{config.model_type}' model, not a causal language model; "
        f"attnsurg works on decoder LMs (surgery supports: {supported_names()})"
    )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N")
    if resolved.type not in ("cpu", "cuda"):
        raise UserError(f"device '{device}' is not one attnsurg runs on; use auto, cpu, cuda or cuda:N")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device '{device}' requested but no CUDA GPU is available; use --device cpu")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise UserError(f"device '{device}' requested but this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return resolved


def resolve_dtype(dtype: str, device: torch.device, config: PretrainedConfig | None = None) -> torch.dtype:
    """``auto`` means float32 on CPU and the checkpoint's own half precision on a GPU."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype '{dtype}'; use auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    native = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
    return DTYPES.get(native, torch.bfloat16) if native in ("bfloat16", "float16") else torch.bfloat16


def load_model(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> PreTrainedModel:
    """The model in ``dtype`` on ``device``, refused when its weights do not fill the model its config builds
    (transformers would fill the gaps with random initial values) or hold NaN or infinity."""
    if source.kind == "gguf":
        model, info = load_gguf(Path(source.path) / source.gguf_file, dtype)
    else:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                source.path,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                use_safetensors=None if allow_pickle else True,
                output_loading_info=True,
            )
        except OSError as exc:
            raise UserError(f"cannot load the weights of '{source.ref}' ({_first_line(exc)})")
        except ValueError as exc:
            raise UserError(_remote_code_or(exc, source))
    require_complete(info, source.ref)
    for name, tensor in model.state_dict().items():
        require_finite(name, tensor, source.ref)
    return model.to(device).eval()


def require_complete(info: dict, ref: str) -> None:
    """The loading report of ``from_pretrained`` names no weight the model needs that the files lack, or hold
    in another shape."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise UserError(f"'{ref}' lacks {len(missing)} weight(s) its config needs ({', '.join(missing[:2])}"
                        f"{', ...' if len(missing) > 2 else ''}): the checkpoint is incomplete or its config names "
                        "more layers than its weights hold; copy or download it again")
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        first = mismatched[0]
        name = first[0] if isinstance(first, (tuple, list)) else first
        raise UserError(f"'{ref}' holds '{name}' in a shape its config does not build: the weights and the config "
                        "do not belong together; copy or download the checkpoint again")


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    """The source's tokenizer, refused when its vocabulary is larger than the model's embedding (another model's
    tokenizer: text would tokenize to ids with no embedding). Tokens added beyond it, such as the end-of-text
    token transformers adds reading a GGUF, are left alone."""
    try:
        if source.kind == "gguf":
            tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        if "trust_remote_code" in str(exc):
            raise UserError(f"the tokenizer of '{source.ref}' needs its own code; pass --trust-remote-code if you "
                            "trust it") from None
        raise UserError(f"'{source.ref}' has no usable tokenizer ({_first_line(exc)}); add tokenizer files to it")
    vocab = load_config(source, trust_remote_code).vocab_size
    if tokenizer.vocab_size > vocab:
        raise UserError(f"the tokenizer of '{source.ref}' has {tokenizer.vocab_size} tokens but the model embeds {vocab}: "
                        "ids past that have no embedding; use the tokenizer the model was trained with")
    return tokenizer


@contextmanager
def layer_readable(source: ModelSource, beside: Path, allow_pickle: bool = False,
                   trust_remote_code: bool = False) -> Iterator[ModelSource]:
    """The source as a safetensors checkpoint directory that a surgery reads one tensor at a time: itself (a
    hub id: its snapshot, downloaded as ``from_pretrained`` would), or (a .gguf file, pickle weights) the model
    loaded once and written as one beside ``beside`` in its own dtype (a .gguf dequantized to float32),
    removed after the run."""
    if source.kind == "hub" and reads_lazily(snapshot := downloaded(source, trust_remote_code)):
        source = ModelSource(source.ref, "dir", str(snapshot))
    if source.kind in ("dir", "builtin") and reads_lazily(Path(source.path)):
        yield source
        return
    beside = Path(beside)
    staged = beside.parent / f".{beside.name}.source"
    shutil.rmtree(staged, ignore_errors=True)
    try:
        config = load_config(source, trust_remote_code)
        dtype = DTYPES.get(str(config.dtype or "float32").removeprefix("torch."), torch.float32)
        with ui.status(f"Writing {source.ref} as safetensors in '{staged}' to read it a layer at a time..."):
            model = load_model(source, dtype, "cpu", trust_remote_code, allow_pickle)
            model.save_pretrained(staged)
            load_tokenizer(source, trust_remote_code).save_pretrained(staged)
            del model
        yield ModelSource(source.ref, "dir", str(staged), origin=str(source.files))
    finally:
        shutil.rmtree(staged, ignore_errors=True)


HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]  # no pickle weights


def downloaded(source: ModelSource, trust_remote_code: bool = False) -> Path:
    """A hub model's snapshot in the hub cache: its config, safetensors weights and tokenizer files (its code
    too with ``trust_remote_code``); never pickle weights."""
    patterns = HUB_FILES + (["*.py"] if trust_remote_code else [])
    try:
        return Path(snapshot_download(source.path, allow_patterns=patterns))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot download '{source.ref}' from the hub ({_first_line(exc)})")
