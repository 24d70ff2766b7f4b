"""The embedded default model: a tiny random-weight MiniMax-H3 in the Hugging Face repository layout.

It has the real classes and the real latent interface (24 video channels, 16x spatial and 4x temporal
compression, 17n+5 frames, 32 audio channels at 40 latents/s) at widths and depths that run in seconds on a
CPU. It renders noise: it exists so that every code path, loading included, runs without real weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from platformdirs import user_cache_dir

# Bumped whenever the tiny architecture or its seed changes, so stale cache copies are never reused.
TINY_VERSION = 3
TINY_SEED = 1101
# The ref2va partition gets weights of its own, so a run that drives the wrong partition cannot pass a parity test.
TINY_REF_SEED = 1102
# The repository's canvas rule, saved in its modular_model_index.json: the tiny model generates at 32 px, so keyframe
# canvases, video references and image references are put on that scale rather than the released 768 / 2048 px.
TINY_CANVAS = dict(canvas_short_edge=32, canvas_max_pixels=32 * 32, reference_image_short_edge=64)
TINY_NOTICE = (
    "the embedded tiny model is a smoke-test model with random weights: it renders noise. "
    "Point --model (or H3GEN_MODEL) at a MiniMax-H3 repository for real clips."
)

# Qwen3-VL needs these in its vocabulary; H3 reads hidden state 50, so the text stack keeps 51 layers.
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                   "<|image_pad|>", "<|video_pad|>"]
_TOKENIZER_CORPUS = [
    "a red fox runs through fresh snow at dawn, its breath steaming",
    "waves crash on a rocky shore under a grey sky while gulls cry",
    "a street musician plays violin in the rain, people hurry past with umbrellas",
    "the camera flies over a green valley with a river and a small village",
]


def default_tiny_dir() -> Path:
    return Path(user_cache_dir("h3gen")) / f"tiny-v{TINY_VERSION}"


def ensure_tiny_model(target: Path | None = None, on_repair=None) -> Path:
    """Return the tiny model's directory (absolute), writing it first when it is not there yet or is damaged
    (`on_repair(target)` is called before a damaged copy is written again). A folder that holds anything else is
    never written over. Runs that start together write it once: the writer holds a lock on the folder above it, and
    a run that waited for the lock uses what the writer wrote."""
    from h3gen.errors import UsageError

    default = target is None
    target = (default_tiny_dir() if default else Path(target).expanduser()).absolute()
    if target.exists() and not target.is_dir():
        raise UsageError(f"{target} is a file", "pass a folder for the tiny model that is new or empty")
    if in_place(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with writer_lock(target.parent):
            if not in_place(target):
                if on_repair is not None and target.is_dir() and any(target.iterdir()):
                    on_repair(target)
                write_into(target)
    except UsageError:  # the folder came to hold other files meanwhile
        raise
    except Exception as e:  # OSError, or safetensors' own error for a full disk
        raise write_failure(target, e, default) from None
    return target


def in_place(target: Path) -> bool:
    """Whether the tiny model is at `target`, whole; False where the folder is not there or is empty, or holds a
    damaged tiny model (which is written again). A folder that holds anything else is refused."""
    from h3gen.errors import ModelError, UsageError
    from h3gen.models.repo import ModelRepo

    if not target.is_dir() or not any(target.iterdir()):
        return False
    if not is_tiny_model(target):
        raise UsageError(f"{target} holds other files, and the tiny model is written only into a new or empty "
                         "folder", "pass a folder for the tiny model that is new or empty")
    try:
        ModelRepo(target)
    except ModelError:
        return False
    return files_intact(target)


@contextlib.contextmanager
def writer_lock(folder: Path):
    """An exclusive lock on `folder` itself (no lock file left behind), held while the tiny model is written in it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def is_tiny_model(directory: Path) -> bool:
    """Whether `directory` is a tiny model h3gen wrote (its file list is there, or its README says so), so that it
    may be written anew."""
    if (directory / FILE_LIST).is_file():
        return True
    try:
        return (directory / "README.md").read_text().startswith("h3gen tiny model")
    except (OSError, UnicodeDecodeError):
        return False


FILE_LIST = ".h3gen-tiny-files.json"  # each file's SHA-256, written with the model (hidden: no part of its identity)


def file_digests(directory: Path) -> dict[str, str]:
    return {path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file() and path.name != FILE_LIST}


def files_intact(directory: Path) -> bool:
    """Whether every file the tiny model was written with is there with its bytes (8 MB to read: milliseconds)."""
    try:
        listed = json.loads((directory / FILE_LIST).read_text())
        return all(hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest
                   for name, digest in listed.items())
    except (OSError, ValueError, AttributeError):
        return False


def write_into(target: Path) -> None:
    """Write the tiny model beside `target` and put it in place whole (a damaged copy of it is replaced)."""
    from h3gen.run.quiet import quiet_libraries

    quiet_libraries()  # no third-party progress bars ("Writing model shards") in the user's log
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        write_tiny_model(staging, final_dir=target)
        (staging / FILE_LIST).write_text(json.dumps(file_digests(staging), indent=1))
        follow_umask(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def follow_umask(root: Path) -> None:
    """`root` and everything under it with the modes a plain write gives (0666 and 0777 less the umask), readable by
    whom the user's other files are: tempfile makes the folder 0700 and safetensors' writer its files 0600."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def write_failure(target: Path, error: Exception, default: bool):
    """The one-line error of a tiny model that could not be written: a full disk is a write error (exit 1), a folder
    that cannot be written is a usage error (exit 2)."""
    import errno

    from h3gen.errors import UsageError, WriteError

    reason = getattr(error, "strerror", None) or (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = "the cache folder (XDG_CACHE_HOME)" if default else str(target.parent)
    text = f"cannot write the tiny model into {target} ({reason})"
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        limit = "a file size limit stops it: raise `ulimit -f`"
        return WriteError(text, f"{limit}, or pass --model" if default else limit)
    if not isinstance(error, OSError) or error.errno in (errno.ENOSPC, errno.EDQUOT):
        return WriteError(text, f"free space in {where}, or pass --model" if default else f"free space in {where}")
    fix = "set XDG_CACHE_HOME to a folder you can write to, or pass --model" if default else \
        "pass a folder you can write to"
    return UsageError(text, fix)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    return Qwen2TokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                              unk_token=None)


def _tiny_text_encoder(tokenizer):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>")
           for name in ("image_pad", "video_pad", "vision_start", "vision_end")}
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=51,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image_pad"],
                           video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
                           vision_end_token_id=ids["vision_end"])
    return Qwen3VLForConditionalGeneration(config).eval()


def _tiny_components():
    import torch
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    torch.manual_seed(TINY_SEED)
    tokenizer = _tiny_tokenizer()
    generator = torch.Generator().manual_seed(TINY_SEED)
    latents_mean = (torch.randn(24, generator=generator) * 0.1).tolist()
    latents_std = (1.0 + torch.rand(24, generator=generator) * 0.5).tolist()
    return dict(
        tokenizer=tokenizer,
        text_encoder=_tiny_text_encoder(tokenizer),
        processor=Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2),
                                   tokenizer=tokenizer,
                                   video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2)),
        transformer=_tiny_transformer(),
        vae=AutoencoderKLMiniMaxH3(
            block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, decoder_num_layers=1,
            decoder_num_attention_heads=2, decoder_attention_head_dim=16,
            latents_mean=latents_mean, latents_std=latents_std),
        audio_vae=AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4, latent_dim=64, num_attention_heads=2, decoder_dim=128,
            resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
            latents_mean=[0.0] * 32, latents_std=[1.0] * 32),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )


def _tiny_transformer():
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=128, hidden_size=64, num_layers=2, num_refiner_layers=1,
        ffn_dim=128, text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32)


def _tiny_ref_transformer():
    """Built after every other component from a seed of its own, so they keep the weights of earlier versions."""
    import torch

    torch.manual_seed(TINY_REF_SEED)
    return _tiny_transformer()


def write_tiny_model(directory: Path, final_dir: Path | None = None) -> None:
    """Write the tiny model with diffusers' own `save_pretrained`, so its layout is the real repository's."""
    import warnings

    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = MiniMaxH3Blocks().init_pipeline()
        pipe.update_components(**_tiny_components(), transformer_ref=_tiny_ref_transformer(), **TINY_CANVAS)
        pipe.save_pretrained(str(directory))
    # The index records where each component was saved; point it at the directory it will live in.
    index_path = directory / "modular_model_index.json"
    index = index_path.read_text().replace(json.dumps(str(directory))[1:-1],
                                           json.dumps(str(final_dir or directory))[1:-1])
    index_path.write_text(index)
    (directory / "README.md").write_text(f"h3gen tiny model v{TINY_VERSION}: {TINY_NOTICE}\n")
