"""Prompt embeddings on disk, so a second run over the same prompts never loads the text encoder.

An entry is keyed by the encoder's weights, the tokenizer, the prompt and the encode settings. Weights are
fingerprinted without reading tens of gigabytes: each safetensors file's header (names, shapes, offsets), its
size and samples of its bytes; small files are hashed whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from platformdirs import user_cache_dir

WHOLE_FILE_LIMIT = 64 * 2**20
SAMPLE_BYTES, SAMPLES = 2**20, 4


def cache_dir() -> Path:
    return Path(user_cache_dir("h3gen")) / "embeddings"


def file_fingerprint(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= WHOLE_FILE_LIMIT:
            digest.update(f.read())
            return
        header_len = int.from_bytes(f.read(8), "little")
        digest.update(f.read(min(header_len, WHOLE_FILE_LIMIT)))
        for i in range(SAMPLES):
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))


def encoder_fingerprint(folders: list[Path]) -> str:
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            file_fingerprint(path, digest)
    return digest.hexdigest()


class EmbeddingCache:
    """Entries in `directory`, held to `max_bytes` (0: no limit) by removing the least recently used ones as this
    process adds more: a hit marks its entry used (its mtime), and entries other runs share or remove are only ever
    a miss for them, never an error."""

    def __init__(self, encoder: str, settings: dict, directory: Path | None = None, max_bytes: int = 0):
        self.directory = directory or cache_dir()
        self.prefix = json.dumps({"encoder": encoder, **settings}, sort_keys=True)
        self.problem = ""  # why the first entry that could not be written was not, for the run to say once
        self.max_bytes, self.held = max_bytes, None  # the bytes the directory holds, once put first counts them

    def path(self, prompt: str) -> Path:
        key = hashlib.sha256(f"{self.prefix}\0{prompt}".encode()).hexdigest()
        return self.directory / key[:2] / f"{key}.safetensors"

    def get(self, prompt: str):
        from safetensors.torch import load_file

        path = self.path(prompt)
        if not path.is_file():
            return None
        try:
            entry = load_file(str(path))
        except Exception:  # a damaged entry is a miss; it is rewritten
            return None
        try:
            os.utime(path)  # used now: the last to go when the cache is pruned
        except OSError:
            pass
        return entry["prompt_embeds"], entry["text_token_tags"]

    def put(self, prompt: str, prompt_embeds, text_token_tags) -> None:
        from h3gen.run.outputs import save_tensors

        path = self.path(prompt)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_tensors({"prompt_embeds": prompt_embeds.detach().cpu().contiguous(),
                          "text_token_tags": text_token_tags.cpu().contiguous()}, path)
            self.keep_to_size(path.stat().st_size)
        except OSError as e:  # a cache that cannot be written only costs speed
            self.problem = self.problem or (
                f"the embedding cache in {self.directory} cannot be written ({e.strerror or e}): these prompts are "
                "encoded again on the next run (set encode.cache_dir or XDG_CACHE_HOME to a folder you can write to)")

    def keep_to_size(self, added: int) -> None:
        """Count an entry just written; past `max_bytes`, remove the least recently used entries down to 90% of it
        (so that the next few entries do not each scan the directory)."""
        if not self.max_bytes:
            return
        if self.held is not None:
            self.held += added
            if self.held <= self.max_bytes:
                return
        entries = []
        for path in self.directory.glob("??/*.safetensors"):
            try:
                stat = path.stat()
            except OSError:  # removed by another run meanwhile
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        self.held = sum(size for _, size, _ in entries)
        if self.held <= self.max_bytes:
            return
        for _, size, path in sorted(entries, key=lambda entry: entry[0]):
            if self.held <= 0.9 * self.max_bytes:
                break
            path.unlink(missing_ok=True)
            self.held -= size
