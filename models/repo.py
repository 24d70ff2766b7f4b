"""A MiniMax-H3 repository on disk, in the layout of the Hugging Face repo `MiniMaxAI/MiniMax-H3`.

Only local files and only safetensors: h3gen never unpickles a checkpoint and never runs remote code.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from h3gen.errors import ModelError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
WEIGHTED = ("transformer", "vae", "audio_vae", "text_encoder")
TINY_WIDTH_LIMIT = 1024  # the DiT's hidden size: the tiny model's is 64, MiniMax-H3's thousands
CONFIG_ONLY = {"tokenizer": ("tokenizer.json", "tokenizer_config.json"),
               "processor": ("processor_config.json", "preprocessor_config.json")}


def check_safetensors(path: Path) -> None:
    """Read the header of one safetensors file, naming the file when it is truncated, has bytes past its tensors' end or
    is not safetensors."""
    try:
        safetensors_header(path)
    except ValueError as e:
        raise ModelError(f"corrupt or truncated checkpoint {path} ({e})",
                         "re-download this file from the repository") from None


def safetensors_header(path: Path) -> dict:
    """One safetensors file's header, the file checked whole against it; ValueError saying why it is not (cut short,
    bytes past its tensors' end, not safetensors)."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than a header")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > path.stat().st_size - 8:  # not read: a length from a file that is not one can be any
                raise ValueError("truncated, or not safetensors: its header would be longer than the file")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        stray = path.stat().st_size - (8 + header_len + end)
        if stray < 0:
            raise ValueError("truncated")
        if stray > 0:  # safetensors refuses such a file as it loads, naming no cause
            raise ValueError(f"{stray} stray bytes after its tensors")
        return header
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, MemoryError, OverflowError) as e:
        raise ValueError(str(e) if isinstance(e, ValueError) and str(e) else "its header is not a safetensors "
                         "header") from None


def read_json_object(path: Path) -> dict:
    """A config or index file of the repository: a JSON object, or an error that names the file."""
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is not valid JSON ({str(e).splitlines()[0]})",
                         "re-download this file from the repository") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path} holds a JSON {type(value).__name__}, not an object",
                         "re-download this file from the repository")
    return value


KIND_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


def mistyped(config: dict, defaults: dict) -> str:
    """The first value of `config` whose type is not that of its default in `defaults` (a count written as a
    string), said as `key is value, where a type belongs`; "" when every value fits. A whole number stands for a
    float; True is no count."""
    for key, value in config.items():
        default = defaults.get(key)
        kind = type(default)
        if default is None or value is None or kind not in (int, float, bool, str):  # null: the class's choice
            continue
        fits = (isinstance(value, (int, float)) if kind is float else isinstance(value, kind)) and (
            kind is bool or not isinstance(value, bool))
        if not fits:
            return f"{key} is {json.dumps(value)[:80]}, where {KIND_WORDS[kind]} belongs"
    return ""


def check_config_types(folder: Path, cls) -> None:
    """`folder`'s config.json against the defaults of `cls.__init__` (a diffusers or transformers class reads its
    config into those arguments): a value of the wrong type is the file's fault, said before the class trips on it."""
    import inspect

    path = folder / "config.json"
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if not path.is_file():
        return
    problem = mistyped(read_json_object(path), {name: p.default for name, p in parameters.items()
                                                if p.default is not inspect.Parameter.empty})
    if problem:
        raise ModelError(f"{path}: {problem}", "re-download this file from the repository")


class ModelRepo:
    """Paths of one repository's components, validated before any weight is loaded."""

    def __init__(self, root: Path | str, components=WEIGHTED + tuple(CONFIG_ONLY)):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            what = "is a file" if self.root.exists() else "does not exist"
            raise ModelError(f"model directory {self.root} {what}",
                             "pass --model DIR pointing at a MiniMax-H3 repository")
        for name in components:
            self._check(name)
        self.canvas_rules()  # read now: a damaged one stops the run before any weight loads

    def canvas_rules(self) -> dict:
        """What the repository's modular_model_index.json declares (the canvas rules of keyframes and references);
        {} where it has none."""
        path = self.root / "modular_model_index.json"
        return read_json_object(path) if path.is_file() else {}

    def path(self, component: str) -> Path:
        return self.root / component

    def load(self, component: str, cls, **kwargs):
        """`cls.from_pretrained` on one component folder: local files, safetensors, no remote code."""
        if getattr(cls, "h3gen_loader", False):
            return load_component(component, cls.from_pretrained, self.path(component), **kwargs)
        check_config_types(self.path(component), cls)
        safe = dict(local_files_only=True, trust_remote_code=False) if component in CONFIG_ONLY else dict(
            local_files_only=True, use_safetensors=True)
        return load_component(component, cls.from_pretrained, self.path(component), **safe, **kwargs)

    def transformer_config(self) -> dict:
        """The DiT's config.json, read before any weight loads."""
        return read_json_object(self.path("transformer") / "config.json")

    def text_dim(self) -> int:
        return self.transformer_config().get("text_dim", 5120)

    def kind(self) -> str:
        """"tiny" for a smoke-test model (the embedded one: a DiT a few dozen wide), else "MiniMax-H3"; read from the
        transformer's config, before any weight loads."""
        return "tiny" if self.transformer_config().get("hidden_size", 0) < TINY_WIDTH_LIMIT else "MiniMax-H3"

    def weight_bytes(self, component: str) -> int:
        """The bytes of a component's weight files: what it holds in memory at the checkpoint's precision."""
        return sum(path.stat().st_size for path in self.path(component).glob("*.safetensors"))

    def text_encoder_identity(self) -> str:
        """What the embedding cache keys on: a fingerprint of the text encoder's and the tokenizer's files."""
        from h3gen.run.embedding_cache import encoder_fingerprint

        return encoder_fingerprint([self.path("text_encoder"), self.path("tokenizer")])

    def text_encoder_config(self):
        from transformers import AutoConfig

        return load_component("text_encoder config", AutoConfig.from_pretrained, self.path("text_encoder"),
                              local_files_only=True)

    def text_encoder_layers(self) -> int:
        """The text encoder's decoder layers, read from its config.json (the launcher of a run sizes memory with it
        and need not import transformers); through transformers' config where the file leaves the count out."""
        layers = read_json_object(self.path("text_encoder") / "config.json").get("text_config", {})
        layers = layers.get("num_hidden_layers") if isinstance(layers, dict) else None
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
            return layers
        return self.text_encoder_config().text_config.num_hidden_layers

    def _check(self, name: str) -> None:
        folder = self.root / name
        if not folder.is_dir():
            raise ModelError(f"{folder} is missing: not a MiniMax-H3 repository layout",
                             "the repository needs transformer/, vae/, audio_vae/, text_encoder/, tokenizer/, processor/")
        if name in CONFIG_ONLY:
            if not any((folder / f).is_file() for f in CONFIG_ONLY[name]):
                raise ModelError(f"{folder} has none of {', '.join(CONFIG_ONLY[name])}",
                                 "copy the complete folder from the repository")
            # The vocabulary itself: without it the tokenizer loads empty and every prompt encodes to nothing.
            if name == "tokenizer" and not (folder / "tokenizer.json").is_file() and not all(
                    (folder / f).is_file() for f in ("vocab.json", "merges.txt")):
                raise ModelError(f"{folder} has no tokenizer.json (nor vocab.json and merges.txt)",
                                 "copy the complete folder from the repository")
            return
        if not (folder / "config.json").is_file():
            raise ModelError(f"{folder / 'config.json'} is missing", "copy the complete folder from the repository")
        read_json_object(folder / "config.json")
        weights = sorted(folder.glob("*.safetensors"))
        if not weights:
            pickles = [p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise ModelError(f"{pickles[0]} is a pickle checkpoint; h3gen loads safetensors only",
                                 "download the .safetensors files of the repository instead")
            raise ModelError(f"no .safetensors weights in {folder}", "copy the weights from the repository")
        for index in folder.glob("*.safetensors.index.json"):
            shards = set(read_json_object(index).get("weight_map", {}).values())
            for shard in sorted(shards):
                if not (folder / shard).is_file():
                    raise ModelError(f"{folder / shard} is missing (listed in {index.name})",
                                     "download every shard of the checkpoint")
        for weight in weights:
            check_safetensors(weight)


def load_component(name: str, loader, *args, **kwargs):
    """Call a from_pretrained loader, turning a failure into an error that names the component."""
    try:
        return loader(*args, **kwargs)
    except ModelError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "meta tensor" in first:  # a module the config declares and the weights never filled
            first = "the weights lack tensors its config declares"
        first = " ".join(first.split(" If you want to instead overwrite")[0].split())  # not diffusers' advice
        folder = Path(args[0]) if args and isinstance(args[0], (str, Path)) else None
        if folder is not None and folder.is_dir():  # a file of it that is not JSON is the likeliest cause: named
            for path in sorted(folder.glob("*.json")):
                read_json_object(path)
        if folder is None or not (folder / "config.json").is_file():
            raise ModelError(f"cannot load {name}: {first[:300]}",
                             "check that the folder matches the repository (config and weights of one release)") from e
        raise ModelError(f"cannot load {name}: {first[:300]}",
                         f"check that {folder / 'config.json'} and the weights beside it come from one release") from e
